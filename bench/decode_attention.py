"""The decode step's attention: torch's fused attention over the longest row's width (``sdpa``) against miServer's
native kernel over each row's own columns (``kernel``, float32 cache) and the same kernel over a bfloat16 KV cache
(``kernel-bf16``, the served default), on the embedded SmolLM2-135M as the engine loads it, with the served
bfloat16 products.

Each variant holds ``--rows`` slots prefilled with prompts of random lengths between ``--min-len`` and ``--max-len``
tokens (a packed batch's rows mid-way: prompts plus what they generated so far) and times the decode step of its
first 1, 8 and all rows (median of ``--steps`` steps). Rounds alternate the variants' order (ABC, CBA, ...) and
record the load average; the summary gives each variant's medians and their ratio to ``sdpa`` in the same round.

    .venv/bin/python bench/decode_attention.py
    .venv/bin/python bench/decode_attention.py --rounds 4 --rows 17

Results: ``bench/results/decode_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # the server's default (engines/local/thread.py)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.engines.local.loader import load_model, resolve_model_source  # noqa: E402
from miserver.engines.local.slots import AttentionKind, KVCacheKind, SlotModel  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID, Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VARIANTS: dict[str, tuple[AttentionKind, KVCacheKind]] = {
    "sdpa": ("sdpa", "model"),
    "kernel": ("kernel", "model"),
    "kernel-bf16": ("kernel", "bfloat16"),
}


def step_ms(cache: SlotModel, rows: int, prompts: list[torch.Tensor], steps: int) -> float:
    """Median milliseconds of a decode step of slots ``0 .. rows - 1``, freshly prefilled from ``prompts``."""
    for slot in range(rows):
        cache.prefill(slot, prompts[slot])
    slots = list(range(rows))
    for _ in range(2):  # warm-up
        cache.decode(slots, [5] * rows)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        cache.decode(slots, [5] * rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=17, help="slots of the widest step (16 batch rows + 1 chat)")
    parser.add_argument("--min-len", type=int, default=60)
    parser.add_argument("--max-len", type=int, default=250)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per shape")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    # the model as the engine loads it, driven from this one thread (one OpenMP team, as in the server)
    model = load_model(resolve_model_source(EMBEDDED_MODEL_ID, None), Settings().cache_dir, "cpu").model
    context = int(model.config.max_position_embeddings)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.rows,), generator=generator).tolist()
    prompts = [torch.randint(0, 1000, (n,), generator=generator) for n in lengths]
    shapes = sorted({1, min(8, args.rows), args.rows})
    info: dict[str, Any] = {
        "model": EMBEDDED_MODEL_ID,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "prompt_lengths": lengths,
        "steps": args.steps,
    }
    print(json.dumps(info), flush=True)
    rounds: list[dict[str, Any]] = []
    with torch.inference_mode():
        caches = {}
        for name, (attention, kv_cache) in VARIANTS.items():
            cache = SlotModel(
                model,
                max_positions=context,
                weights="bfloat16",
                own_prefill=True,
                attention=attention,
                kv_cache=kv_cache,
            )
            if cache.attention != attention:
                sys.exit(f"{name}: the attention kernel did not build here (see the log)")
            caches[name] = cache
        names = list(VARIANTS)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            block: dict[str, Any] = {"round": r + 1, "order": order, "load_before": os.getloadavg()[0]}
            for name in order:
                block[name] = {str(rows): round(step_ms(caches[name], rows, prompts, args.steps), 2) for rows in shapes}
            block["load_after"] = os.getloadavg()[0]
            rounds.append(block)
            print(json.dumps(block), flush=True)
    summary: dict[str, Any] = {}
    for name in names:
        for rows in map(str, shapes):
            summary[f"{name} {rows} rows ms"] = [b[name][rows] for b in rounds]
            if name != "sdpa":
                summary[f"{name} / sdpa {rows} rows"] = [round(b[name][rows] / b["sdpa"][rows], 3) for b in rounds]
    print(json.dumps(summary, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "decode_attention.json"
    out.write_text(json.dumps({"info": info, "rounds": rounds, "summary": summary}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
