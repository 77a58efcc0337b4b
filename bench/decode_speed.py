"""Decode speed of the step loop's caches: transformers' (``hf_cache.HFSlots``) against the static-cache slot forward
(``slots.SlotModel``), on the embedded SmolLM2-135M as the engine loads it (float32 on the CPU).

Measured per variant, interleaved: each variant's sequence runs ``--block`` steps in turn, the order reversed every
other block (ABBA), so a change of machine load hits every variant alike; each block's rate is printed with the load
average and the CPU time the process spent per token (every thread; far less sensitive to other processes than the
wall time), and the summary gives each variant's medians over blocks and its median ratio to the first variant's
block beside it (the machine may be shared: trust ratios and CPU time, not absolute rates). Every forward pass of
``single`` and ``batch`` runs on the engine thread of one ``LocalEngine``, with the OpenMP team the server uses:

- ``single``: one sequence, ``--tokens`` greedy decode steps after a chat prompt (end of sequence ignored);
- ``batch``: ``--rows`` sequences at different prompt lengths, ``--batch-steps`` decode steps of all of them, each
  step one forward pass, tokens/s over every row;
- ``engine``: one greedy request of ``--tokens`` tokens through ``LocalEngine.generate`` (scheduler, sampling and
  detokenising included; end of sequence ignored), tokens/s from submission to result, ``--engine-rounds`` times.

Variants: ``transformers`` (HFSlots), ``slots`` (SlotModel, float32), ``slots-t`` (SlotModel with contiguous
``[in, out]`` copies of the projections), ``slots-p`` (SlotModel with copies prepacked for oneDNN), ``slots-b``
(SlotModel with bfloat16 copies prepacked for oneDNN, the products in bfloat16 and the rest in float32: the served
default where the CPU multiplies bfloat16 natively), ``slots-bf16`` (SlotModel over a bfloat16 copy of the whole
model: measured, not served), ``slots-compiled`` (SlotModel with ``torch.compile``: minutes of compiling on a first
run, not in the default list), ``served`` (the server's default, ``decoding.DEFAULT_DECODE``: a quantized
model's matrices in their own bits for steps of a few rows) and ``served-float`` (the same without them). The greedy
tokens of each variant are compared with the first variant's.

    python bench/decode_speed.py
    python bench/decode_speed.py --variants transformers,slots,slots-compiled --engine-rounds 0

Results are printed and written to ``bench/results/decode_speed.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

# Other processes may share the cores: passive OpenMP waiting (see bench/packing.py). Set before torch starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from miserver.engines.local.decoding import DEFAULT_DECODE, DecodeOptions, make_slots  # noqa: E402
from miserver.engines.local.engine import LocalEngine  # noqa: E402
from miserver.engines.local.hf_cache import HFSlots  # noqa: E402
from miserver.engines.local.slots import SlotModel  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID, Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ROWS = [
    "Summarize: the central bank raised interest rates again on Thursday.",
    "What is the capital of France?",
    "Explain photosynthesis to a child in three sentences, using simple words and an example from the garden.",
    "List three uses of copper.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves falling in a quiet park at dusk.",
    "Name a prime number larger than 100.",
]

Cache = HFSlots | SlotModel


def load() -> float:
    return round(os.getloadavg()[0], 2)


class Single:
    """One greedy sequence in slot 0 of ``cache``, decoded block by block (end of sequence ignored)."""

    def __init__(self, cache: Cache, ids: torch.Tensor) -> None:
        self.cache = cache
        self.tokens = [int(torch.argmax(cache.prefill(0, ids)))]

    def run(self, steps: int) -> tuple[float, float]:
        """Tokens/s of ``steps`` more decode steps, and the CPU milliseconds (every thread) per token."""
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            logits = self.cache.decode([0], [self.tokens[-1]])[0]
            self.tokens.append(int(torch.argmax(logits)))
        return steps / (time.perf_counter() - start), (time.process_time() - cpu) * 1000 / steps


class Batch:
    """``rows`` greedy sequences at their own prompt lengths in slots 1.., decoded together block by block."""

    def __init__(self, cache: Cache, rows: list[torch.Tensor]) -> None:
        self.cache = cache
        self.slots = list(range(1, len(rows) + 1))
        self.tokens = [int(torch.argmax(cache.prefill(s, ids))) for s, ids in zip(self.slots, rows, strict=True)]

    def run(self, steps: int) -> tuple[float, float]:
        """Tokens/s over every row of ``steps`` more decode steps, and the CPU milliseconds per token."""
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            logits = self.cache.decode(self.slots, self.tokens)
            self.tokens = [int(t) for t in torch.argmax(logits, dim=-1)]
        tokens = len(self.slots) * steps
        return tokens / (time.perf_counter() - start), (time.process_time() - cpu) * 1000 / tokens


async def engine_single(engine: LocalEngine, ids: list[int], tokens: int) -> float:
    request = GenerationRequest(tuple(ids), SamplingParams(max_tokens=tokens, temperature=0.0))
    start = time.perf_counter()
    result = await engine.generate(request)
    return result.completion_tokens / (time.perf_counter() - start)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens of the single stream")
    parser.add_argument("--block", type=int, default=8, help="single-stream steps timed at a time")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--batch-steps", type=int, default=32, help="decode steps of the rows together")
    parser.add_argument("--batch-block", type=int, default=4, help="batch steps timed at a time")
    parser.add_argument("--engine-rounds", type=int, default=2)
    parser.add_argument("--variants", default="transformers,slots,slots-t,slots-bf16")
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end engine measurement")
    args = parser.parse_args()
    base = await LocalEngine.start(EMBEDDED_MODEL_ID, cache_dir=Settings().cache_dir, device="cpu")
    loaded = base.loaded
    model = loaded.model
    context = base.context_length
    variants = args.variants.split(",")
    bf16 = copy.deepcopy(model).to(torch.bfloat16) if "slots-bf16" in variants else None
    makers: dict[str, Callable[[], Cache]] = {
        "transformers": lambda: HFSlots(model, max_positions=context),
        "slots": lambda: SlotModel(model, max_positions=context),
        "slots-t": lambda: SlotModel(model, max_positions=context, weights="transposed"),
        "slots-p": lambda: SlotModel(model, max_positions=context, weights="packed"),
        "slots-b": lambda: SlotModel(model, max_positions=context, weights="bfloat16"),
        "slots-compiled": lambda: SlotModel(model, max_positions=context, compile=True),
        "served": lambda: make_slots(model, context, DEFAULT_DECODE),
        "served-float": lambda: make_slots(model, context, replace(DEFAULT_DECODE, quantized_rows=0)),
    }
    if bf16 is not None:
        makers["slots-bf16"] = lambda: SlotModel(bf16, max_positions=context)
    engines: dict[str, LocalEngine] = {}
    if not args.no_engine:
        for name in ("transformers", "slots"):
            if name in variants:
                engines[name] = LocalEngine.from_loaded(loaded, EMBEDDED_MODEL_ID, decode=DecodeOptions(name))  # type: ignore[arg-type]
                engines[name].eos_ids = frozenset()  # always the full length
    ids = torch.tensor(base.tokenize_chat([{"role": "user", "content": PROMPT}]), dtype=torch.long)
    rows = [torch.tensor(base.tokenize_chat([{"role": "user", "content": r}]), dtype=torch.long) for r in ROWS]
    rows = (rows * (args.rows // len(rows) + 1))[: args.rows]
    info: dict[str, Any] = {
        "model": EMBEDDED_MODEL_ID,
        "dtype": str(model.dtype),
        "torch": torch.__version__,
        "torch_threads": await base.call(lambda _: torch.get_num_threads()),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "tokens": args.tokens,
        "rows": args.rows,
        "batch_steps": args.batch_steps,
        "block": args.block,
    }
    print(json.dumps(info), flush=True)
    # every forward pass runs on the engine thread of ``base``, with its OpenMP team (see ``thread.one_openmp_team``)
    caches = {name: await base.call(lambda _, name=name: makers[name]()) for name in variants}

    def warm(_: object) -> tuple[dict[str, Single], dict[str, Batch]]:
        with torch.inference_mode():  # warm-up: a few steps of each shape
            for cache in caches.values():
                Single(cache, ids).run(4)
                Batch(cache, rows).run(2)
                for s in range(len(rows) + 1):
                    cache.release(s)
            return {n: Single(c, ids) for n, c in caches.items()}, {n: Batch(c, rows) for n, c in caches.items()}

    singles, batches = await base.call(warm)

    def timed(part: Single | Batch, steps: int) -> Callable[[object], tuple[float, float]]:
        def run(_: object) -> tuple[float, float]:
            with torch.inference_mode():
                return part.run(steps)

        return run

    runs: list[dict[str, Any]] = []
    blocks = -(-args.tokens // args.block)
    for r in range(blocks):  # block r of every variant, in turn; the order reversed every other block (ABBA)
        order = variants if r % 2 == 0 else variants[::-1]
        for name in order:
            before = load()
            rate, cpu = await base.call(timed(singles[name], args.block))
            runs.append(
                {
                    "block": r,
                    "variant": name,
                    "what": "single",
                    "tok_s": round(rate, 2),
                    "cpu_ms": round(cpu, 2),
                    "load": before,
                }
            )
            print(json.dumps(runs[-1]), flush=True)
            if r < args.batch_steps // args.batch_block:
                before = load()
                rate, cpu = await base.call(timed(batches[name], args.batch_block))
                runs.append(
                    {
                        "block": r,
                        "variant": name,
                        "what": "batch",
                        "tok_s": round(rate, 2),
                        "cpu_ms": round(cpu, 2),
                        "load": before,
                    }
                )
                print(json.dumps(runs[-1]), flush=True)
    reference = singles[variants[0]].tokens
    agreement = {
        name: next((i for i, (a, b) in enumerate(zip(reference, s.tokens)) if a != b), len(s.tokens))
        for name, s in singles.items()
    }
    print(json.dumps({"greedy_tokens_equal_to_" + variants[0]: agreement}), flush=True)
    for r in range(args.engine_rounds if engines else 0):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            before = load()
            rate = await engine_single(engines[name], ids.tolist(), args.tokens)
            runs.append({"block": r, "variant": name, "what": "engine", "tok_s": round(rate, 2), "load": before})
            print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for what in ("single", "batch", "engine"):
        ref = [x["tok_s"] for x in runs if x["what"] == what and x["variant"] == variants[0]]
        ref = ref or [x["tok_s"] for x in runs if x["what"] == what and x["variant"] == "transformers"]
        for name in variants:
            got = [x["tok_s"] for x in runs if x["what"] == what and x["variant"] == name]
            if not got or not ref:
                continue
            summary.setdefault(what, {})[name] = {
                "median_tok_s": round(statistics.median(got), 2),
                "best_tok_s": round(max(got), 2),
                "ratio_to_" + variants[0]: round(statistics.median(g / b for g, b in zip(got, ref, strict=True)), 2),
            }
            cpu = [x["cpu_ms"] for x in runs if x["what"] == what and x["variant"] == name and "cpu_ms" in x]
            if cpu:
                summary[what][name]["median_cpu_ms_per_token"] = round(statistics.median(cpu), 2)
    info["load_average_at_end"] = os.getloadavg()
    print(json.dumps(summary, indent=2), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "decode_speed.json"
    out.write_text(json.dumps({"info": info, "agreement": agreement, "runs": runs, "summary": summary}, indent=2))
    print(f"written to {out}; load average {os.getloadavg()}")
    for engine in engines.values():
        await engine.close()
    await base.close()


if __name__ == "__main__":
    asyncio.run(main())
