"""Batched generation benchmark: generation rows packed (continuous batching) against one at a time.

Rows: ``--rows`` AG News items (``../shared/data/ag_news_samples.csv``, label-balanced, read in place), each a chat
request asking for a one-sentence summary, greedy (``temperature`` 0), ``max_tokens`` 32 and 128. Both sides run
through the chat service the batch runner calls: ``create`` per row (what ``pack: false`` runs, the synchronous
code) against ``create_many`` with the runner's plan (what ``pack: true`` runs: ``BATCH_GENERATE_SLOTS`` sequences
per decode step, a finished row's slot going to the next row), over the same rows in one run. The machine may be
shared, so the rows are cut into ``--groups`` groups, each timed packed and single back to back, alternating which
side goes first; the ratio is total single time over total packed time. Agreement: rows whose text is identical.

``--sweep`` measures packed rows/s at several slot counts (``--slots-list``) against single, to choose the default.

    python bench/generate_packed.py                            # CPU, the real SmolLM2, 64 rows, max_tokens 32, 128
    python bench/generate_packed.py --sweep --rows 32 --max-tokens 32 --slots-list 2,4,8,16
    python bench/generate_packed.py --device cuda --rows 256 --slots 128            # GPU, bfloat16
    python bench/generate_packed.py --device cuda --rows 256 --slots 128 --random-shape qwen2.5-7b \
        --bandwidth-gbs 4800      # a random-weight 7B shape; decode tokens/s against the card's memory bandwidth

Results are printed and written to ``bench/results/generate_packed.json`` (``generate_packed_sweep.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

# Other processes may share the cores: passive OpenMP waiting (see bench/packing.py). Set before torch starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from miserver.batches.packing import runner_plan  # noqa: E402
from miserver.engines.local.engine import LocalEngine  # noqa: E402
from miserver.scheduling.admission import AdmissionGate, Priority  # noqa: E402
from miserver.services.inference import chat  # noqa: E402
from miserver.services.inference.context import Call, ServiceContext, ServiceResult  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID, Settings  # noqa: E402
from tests.support.agnews import LABELS, balanced_items  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SYSTEM = "Summarize the news item in one sentence."


def bodies(rows: int, max_tokens: int, model: str = EMBEDDED_MODEL_ID) -> list[dict[str, Any]]:
    """``rows`` label-balanced AG News items as greedy chat summary requests to ``model``."""
    items = balanced_items(-(-rows // len(LABELS)))[:rows]
    return [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{it['title']}. {it['description']}"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for it in items
    ]


def call() -> Call:
    return Call(strict=True, priority=Priority.BATCH)


async def single(ctx: ServiceContext, rows: list[dict[str, Any]]) -> tuple[float, list[ServiceResult]]:
    start = time.perf_counter()
    out = []
    for b in rows:
        result = await chat.create(ctx, b, call())
        assert isinstance(result, ServiceResult)
        out.append(result)
    return time.perf_counter() - start, out


async def packed(ctx: ServiceContext, rows: list[dict[str, Any]], slots: int) -> tuple[float, list[ServiceResult], int]:
    plan = runner_plan(Settings(batch_generate_slots=slots))
    start = time.perf_counter()
    found: dict[int, ServiceResult] = {}
    shared = 0
    async for outcome in chat.create_many(ctx, rows, call(), plan):
        assert isinstance(outcome.result, ServiceResult), outcome.result
        found[outcome.index] = outcome.result
        shared += outcome.packed
    return time.perf_counter() - start, [found[i] for i in range(len(rows))], shared


def text(result: ServiceResult) -> str:
    return str(result.body["choices"][0]["message"]["content"])


def tokens(results: list[ServiceResult]) -> int:
    return sum(r.completion_tokens for r in results)


async def compare(ctx: ServiceContext, rows: list[dict[str, Any]], slots: int, groups: int) -> dict[str, Any]:
    """Packed vs single over ``rows``, cut into ``groups`` alternating groups; totals, ratio and agreement."""
    size = -(-len(rows) // groups)
    t_single = t_packed = 0.0
    res_single: list[ServiceResult] = []
    res_packed: list[ServiceResult] = []
    shared = 0
    for g in range(groups):
        part = rows[g * size : (g + 1) * size]
        if not part:
            continue
        if g % 2 == 0:
            tp, rp, sh = await packed(ctx, part, slots)
            ts, rs = await single(ctx, part)
        else:
            ts, rs = await single(ctx, part)
            tp, rp, sh = await packed(ctx, part, slots)
        t_single, t_packed, shared = t_single + ts, t_packed + tp, shared + sh
        res_single += rs
        res_packed += rp
        print(f"  group {g}: {len(part)} rows single {ts:.1f}s packed {tp:.1f}s ({ts / tp:.2f}x)", flush=True)
    same = sum(text(a) == text(b) for a, b in zip(res_single, res_packed, strict=True))
    same_usage = sum(a.completion_tokens == b.completion_tokens for a, b in zip(res_single, res_packed, strict=True))
    n = len(rows)
    return {
        "rows": n,
        "slots": slots,
        "single_s": round(t_single, 2),
        "packed_s": round(t_packed, 2),
        "single_rows_per_s": round(n / t_single, 3),
        "packed_rows_per_s": round(n / t_packed, 3),
        "ratio": round(t_single / t_packed, 2),
        "single_tokens_per_s": round(tokens(res_single) / t_single, 1),
        "packed_tokens_per_s": round(tokens(res_packed) / t_packed, 1),
        "completion_tokens": tokens(res_single),
        "rows_packed": shared,
        "identical_text": same,
        "identical_usage": same_usage,
        "finish_length": sum(r.body["choices"][0]["finish_reason"] == "length" for r in res_single),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", default="32,128", help="comma-separated max_tokens values")
    parser.add_argument("--slots", type=int, default=Settings().batch_generate_slots)
    parser.add_argument("--groups", type=int, default=4, help="alternating groups per comparison")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sweep", action="store_true", help="packed at each of --slots-list against single")
    parser.add_argument("--slots-list", default="2,4,8,16")
    parser.add_argument("--random-shape", help="a randomly initialised model of this shape (see bench/packing.py)")
    parser.add_argument("--bandwidth-gbs", type=float, help="the device's memory bandwidth, GB/s: prints the bound")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.random_shape:
        spec = importlib.util.spec_from_file_location("packing_bench", ROOT / "bench" / "packing.py")
        assert spec is not None and spec.loader is not None
        packing_bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(packing_bench)
        engine = packing_bench.random_engine(args.random_shape, args.device)
    else:
        engine = await LocalEngine.start(EMBEDDED_MODEL_ID, cache_dir=Settings().cache_dir, device=args.device)
    model_id = engine.info.model_id
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    ctx = ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0))
    info: dict[str, Any] = {
        "model": engine.info.model_id,
        "device": args.device,
        "dtype": engine.info.dtype,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_at_start": os.getloadavg(),
        "weights_gb": round(weight_bytes / 1e9, 3),
    }
    if args.bandwidth_gbs:
        # one decode step reads every weight once: the most single-sequence decode steps per second
        info["bandwidth_bound_steps_per_s"] = round(args.bandwidth_gbs * 1e9 / weight_bytes, 1)
    print(json.dumps(info), flush=True)
    warm = bodies(2, 4, model_id)
    await single(ctx, warm)
    await packed(ctx, warm, 2)
    runs = []
    if args.sweep:
        max_tokens = int(args.max_tokens.split(",")[0])
        rows = bodies(args.rows, max_tokens, model_id)
        t_single, res_single = await single(ctx, rows)
        print(f"single: {len(rows) / t_single:.3f} rows/s", flush=True)
        for slots in (int(s) for s in args.slots_list.split(",")):
            t, res, _ = await packed(ctx, rows, slots)
            same = sum(text(a) == text(b) for a, b in zip(res_single, res, strict=True))
            run = {
                "slots": slots,
                "max_tokens": max_tokens,
                "rows": len(rows),
                "packed_s": round(t, 2),
                "single_s": round(t_single, 2),
                "ratio": round(t_single / t, 2),
                "identical_text": same,
            }
            print(json.dumps(run), flush=True)
            runs.append(run)
        out = RESULTS / "generate_packed_sweep.json"
    else:
        for max_tokens in (int(m) for m in args.max_tokens.split(",")):
            print(f"max_tokens {max_tokens}:", flush=True)
            run = {
                "max_tokens": max_tokens,
                **await compare(ctx, bodies(args.rows, max_tokens, model_id), args.slots, args.groups),
            }
            print(json.dumps(run), flush=True)
            runs.append(run)
        out = RESULTS / "generate_packed.json"
    info["load_average_at_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "runs": runs}, indent=2) + "\n")
    print(f"written to {out}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
