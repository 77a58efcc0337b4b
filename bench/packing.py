"""Packing benchmark: packed against single scoring rows and embeddings, through the service layer.

Rows: the first ``--rows`` reviews of ``../shared/data/fine_food_reviews_1k.csv`` as one-token sentiment decisions
(chat completions with ``max_tokens`` 1, ``temperature`` 0, ``logprobs`` with 5 alternatives, one shared instruction),
and the same reviews as embedding inputs. Everything runs through the services the batch runner calls: ``create``
per row (the synchronous path, what ``pack: false`` runs) against ``create_many`` (what ``pack: true`` runs) with:

- ``fixed16``, ``sorted16``, ``budget4k``: the plain planners over all rows at once (packs of 16 in file order, packs
  of 16 after sorting by length, token-budget packs of 4,096 tokens over the sorted rows);
- ``runner/<order>``: the runner's packing: windows of ``BATCH_PACK_WINDOW_ROWS`` rows taken in the given order (file
  order, sorted by length, reversed), each planned with ``BATCH_PACK_TOKEN_BUDGET`` and ``BATCH_PACK_MAX_PADDING``;
  ``runner/file, no padding cap`` shows what the padding cap is worth.

Each step (a pack, or a runner window) is timed packed and with its rows one at a time, back to back, alternating
which side goes first, so that a change of the machine's load affects both sides alike (this machine is shared);
the ratio is the single time over the packed time. Agreement against single: the largest difference of a logprob
(the chosen token's and the top-5 alternatives present in both) and the number of rows whose chosen token changed;
for embeddings (``mean`` and ``last``) the smallest cosine between packed and single vectors. One run each; the
numbers are printed and written to ``bench/results/packing.json``.

    python bench/packing.py                                  # CPU: the real SmolLM2, float32, 200 rows
    python bench/packing.py --device cuda --rows 1000        # GPU: bfloat16
    python bench/packing.py --device cuda --random-shape qwen2.5-7b   # a randomly initialised Qwen2.5-7B shape
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

# Other processes may share the cores: with OpenMP's default active waiting, a 2-thread forward pass on a loaded
# 2-core machine ran 8x slower than with passive waiting (measured). Set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.batches.packing import budget_packs, fixed_packs, runner_plan, sorted_packs  # noqa: E402
from miserver.engines.local.engine import LocalEngine  # noqa: E402
from miserver.engines.local.loader import LoadedModel, load_tokenizer, pick_device, resolve_model_source  # noqa: E402
from miserver.scheduling.admission import AdmissionGate, Priority  # noqa: E402
from miserver.services.inference import chat, embeddings  # noqa: E402
from miserver.services.inference.context import Call, ServiceContext, ServiceResult  # noqa: E402
from miserver.services.inference.many import Plan  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID, Settings  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "fine_food_reviews_1k.csv"
RESULTS = ROOT / "bench" / "results" / "packing.json"
SYSTEM = "You label product reviews. Answer with one word: positive or negative."

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M's shape (random weights); the real model is the default.
    "smollm2": dict(
        arch="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "qwen2.5-7b": dict(
        arch="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
}


def reviews(count: int) -> list[str]:
    with DATA.open(newline="") as fh:
        rows = list(csv.DictReader(fh))[:count]
    return [f"{r['Summary']}\n\n{r['Text']}" for r in rows]


def random_engine(shape: str, device: str | None) -> LocalEngine:
    """A randomly initialised model of ``shape`` with the SmolLM2 tokenizer (its ids fit any of these vocabularies)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    dev, dtype = pick_device(device)
    config = (LlamaConfig if arch == "llama" else Qwen2Config)(**spec)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    tokenizer = load_tokenizer(resolve_model_source(EMBEDDED_MODEL_ID), Settings().cache_dir)
    return LocalEngine.from_loaded(LoadedModel(tokenizer, model, dev, dtype, f"random:{shape}"), f"random-{shape}")


async def singles(service: Any, ctx: ServiceContext, bodies: Sequence[Any]) -> list[ServiceResult]:
    """Each body alone through ``service.create`` (the synchronous path; what ``pack: false`` runs)."""
    call = Call(strict=True, priority=Priority.BATCH)
    out = []
    for body in bodies:
        result = await service.create(ctx, body, call)
        assert isinstance(result, ServiceResult)
        out.append(result)
    return out


async def packed(service: Any, ctx: ServiceContext, bodies: Sequence[Any], plan: Plan) -> list[ServiceResult]:
    """The bodies through ``service.create_many`` with ``plan`` (what a ``pack: true`` batch runs), in input order."""
    call = Call(strict=True, priority=Priority.BATCH)
    results: list[Any] = [None] * len(bodies)
    async for outcome in service.create_many(ctx, list(bodies), call, plan):
        assert isinstance(outcome.result, ServiceResult), outcome
        results[outcome.index] = outcome.result
    return results


def one_pack(lengths: Sequence[int]) -> list[list[int]]:
    return [list(range(len(lengths)))]


Step = tuple[list[int], Plan]  # rows run by one create_many call, and its planner


def global_steps(plan: Plan, lengths: Sequence[int]) -> list[Step]:
    """A planner applied to all rows at once; each of its packs is a step."""
    return [(pack, one_pack) for pack in plan(lengths)]


def window_steps(order: Sequence[int], window: int, plan: Plan, lengths: Sequence[int]) -> list[Step]:
    """The runner: windows of ``window`` rows taken in ``order``, each planned by ``plan``; each pack is a step (the
    runner's ``create_many`` over a window runs exactly these packs, one after another)."""
    steps: list[Step] = []
    for start in range(0, len(order), window):
        rows = list(order[start : start + window])
        steps += [([rows[k] for k in pack], one_pack) for pack in plan([lengths[i] for i in rows])]
    return steps


async def paired(service: Any, ctx: ServiceContext, bodies: Sequence[Any], steps: list[Step]) -> dict[str, Any]:
    """Time every step packed and its rows alone, back to back (alternating which goes first), so that a change
    of the machine's load between steps affects both sides alike. Returns seconds and results by row."""
    t_single = t_packed = 0.0
    alone: dict[int, ServiceResult] = {}
    together: dict[int, ServiceResult] = {}
    for k, (rows, plan) in enumerate(steps):
        subset = [bodies[i] for i in rows]
        for side in (0, 1) if k % 2 == 0 else (1, 0):
            start = time.perf_counter()
            results = await (singles(service, ctx, subset) if side == 0 else packed(service, ctx, subset, plan))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if side == 0:
                t_single += elapsed
                alone.update(zip(rows, results))
            else:
                t_packed += elapsed
                together.update(zip(rows, results))
    n = len(bodies)
    return {
        "single": [alone[i] for i in range(n)],
        "packed": [together[i] for i in range(n)],
        "single_rows_per_s": n / t_single,
        "packed_rows_per_s": n / t_packed,
        "ratio": t_single / t_packed,
    }


def decision(result: ServiceResult) -> tuple[int | str, dict[str, float]]:
    """The chosen token and {token: logprob} of the chosen token and its top alternatives."""
    content = result.body["choices"][0]["logprobs"]["content"][0]
    logprobs = {t["token"]: t["logprob"] for t in content["top_logprobs"]}
    logprobs.setdefault(content["token"], content["logprob"])
    return content["token"], logprobs


def agreement(single: Sequence[ServiceResult], packed: Sequence[ServiceResult]) -> dict[str, float]:
    worst, changed = 0.0, 0
    for a, b in zip(single, packed):
        (ta, la), (tb, lb) = decision(a), decision(b)
        changed += ta != tb
        worst = max([worst, *(abs(la[t] - lb[t]) for t in la.keys() & lb.keys())])
    return {"max_logprob_diff": worst, "top_token_changed": changed}


def min_cosine(single: Sequence[ServiceResult], packed: Sequence[ServiceResult]) -> float:
    worst = 1.0
    for a, b in zip(single, packed):
        for x, y in zip(a.body["data"], b.body["data"]):
            u, v = np.asarray(x["embedding"], dtype=np.float64), np.asarray(y["embedding"], dtype=np.float64)
            worst = min(worst, float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v))))
    return worst


def save(path: Path, report: dict[str, Any]) -> None:
    """Write the report so far (after every scheme: a run cut short keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--model", default=EMBEDDED_MODEL_ID, help="model id or path (default: the embedded SmolLM2)")
    parser.add_argument("--random-shape", choices=sorted(SHAPES), help="a randomly initialised model of this shape")
    parser.add_argument("--window", type=int, default=None, help="runner window rows (default BATCH_PACK_WINDOW_ROWS)")
    parser.add_argument(
        "--budget", type=int, default=None, help="runner token budget (default BATCH_PACK_TOKEN_BUDGET)"
    )
    parser.add_argument("--max-padding", type=float, default=None, help="runner padding cap (BATCH_PACK_MAX_PADDING)")
    parser.add_argument("--skip-embeddings", action="store_true")
    parser.add_argument("--schemes", default=None, help="comma-separated scheme names to run (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    settings = Settings()
    if args.window:
        settings = settings.model_copy(update={"batch_pack_window_rows": args.window})
    if args.budget:
        settings = settings.model_copy(update={"batch_pack_token_budget": args.budget})
    if args.max_padding is not None:
        settings = settings.model_copy(update={"batch_pack_max_padding": args.max_padding})
    if args.random_shape:
        engine = random_engine(args.random_shape, args.device)
    else:
        engine = await LocalEngine.start(model=args.model, cache_dir=settings.cache_dir, device=args.device)
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0))
    model = engine.info.model_id
    texts = reviews(args.rows)
    bodies = [
        {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}],
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
            "seed": 0,
        }
        for t in texts
    ]
    lengths = [len(engine.tokenize_chat([b["messages"][0], b["messages"][1]])) for b in bodies]
    by_length = sorted(range(len(bodies)), key=lambda i: lengths[i])
    orders = {"file": list(range(len(bodies))), "sorted": by_length, "reversed": by_length[::-1]}
    window = settings.batch_pack_window_rows
    print(
        f"{model} on {engine.loaded.device} ({engine.info.dtype}), {len(bodies)} rows, tokens mean "
        f"{np.mean(lengths):.1f} max {max(lengths)}; runner window {window} rows, budget "
        f"{settings.batch_pack_token_budget} tokens, padding cap {settings.batch_pack_max_padding}; "
        f"torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY "
        f"{os.environ['OMP_WAIT_POLICY']}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    await singles(chat, ctx, bodies[:2])  # warm-up
    await packed(chat, ctx, bodies[:8], partial(budget_packs, budget=4096))
    plan = runner_plan(settings)
    uncapped = partial(budget_packs, budget=settings.batch_pack_token_budget, max_padding=1.0)
    schemes: list[tuple[str, list[Step]]] = [
        ("fixed16 (file order)", global_steps(partial(fixed_packs, size=16), lengths)),
        ("sorted16", global_steps(partial(sorted_packs, size=16), lengths)),
        ("budget4k (sorted)", global_steps(partial(budget_packs, budget=4096), lengths)),
        *((f"runner/{name}", window_steps(order, window, plan, lengths)) for name, order in orders.items()),
        ("runner/file, no padding cap", window_steps(orders["file"], window, uncapped, lengths)),
    ]
    report: dict[str, Any] = {
        "setup": {
            "model": model,
            "device": str(engine.loaded.device),
            "dtype": engine.info.dtype,
            "rows": len(bodies),
            "mean_tokens": float(np.mean(lengths)),
            "max_tokens": max(lengths),
            "window_rows": window,
            "token_budget": settings.batch_pack_token_budget,
            "max_padding": settings.batch_pack_max_padding,
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
            "load_average_start": os.getloadavg()[0],
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "scoring": {},
        "embeddings": {},
    }
    reference: list[ServiceResult] | None = None
    header = f"{'scoring':<30}{'single/s':>9}{'packed/s':>9}{'ratio':>7}{'max |dlogprob|':>16}{'top changed':>13}"
    print(header, flush=True)
    wanted = set(args.schemes.split(",")) if args.schemes else {name for name, _ in schemes}
    for name, steps in schemes:
        if name not in wanted:
            continue
        run = await paired(chat, ctx, bodies, steps)
        reference = reference or run["single"]
        agree = agreement(reference, run["packed"])
        entry = {k: run[k] for k in ("single_rows_per_s", "packed_rows_per_s", "ratio")} | agree
        entry["single_repeat_max_logprob_diff"] = agreement(reference, run["single"])["max_logprob_diff"]
        report["scoring"][name] = entry
        save(args.out, report)
        print(
            f"{name:<30}{entry['single_rows_per_s']:>9.2f}{entry['packed_rows_per_s']:>9.2f}{entry['ratio']:>7.2f}"
            f"{agree['max_logprob_diff']:>16.2e}{agree['top_token_changed']:>13d}",
            flush=True,
        )

    if not args.skip_embeddings:
        header = f"{'embeddings (runner/file)':<30}{'single/s':>9}{'packed/s':>9}{'ratio':>7}{'min cosine':>16}"
        print(header, flush=True)
        input_lengths = [len(engine.tokenize(t)) for t in texts]
        for pooling in ("mean", "last"):
            rows = [{"model": model, "input": t, "encoding_format": "float", "pooling": pooling} for t in texts]
            run = await paired(embeddings, ctx, rows, window_steps(orders["file"], window, plan, input_lengths))
            entry = {k: run[k] for k in ("single_rows_per_s", "packed_rows_per_s", "ratio")}
            entry["min_cosine"] = min_cosine(run["single"], run["packed"])
            report["embeddings"][pooling] = entry
            save(args.out, report)
            print(
                f"{pooling:<30}{entry['single_rows_per_s']:>9.2f}{entry['packed_rows_per_s']:>9.2f}"
                f"{entry['ratio']:>7.2f}{entry['min_cosine']:>16.7f}",
                flush=True,
            )

    report["setup"]["load_average_end"] = os.getloadavg()[0]
    save(args.out, report)
    print(f"written {args.out}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
