"""What a decode step costs per row count: the served step loop's cache (``decoding.DEFAULT_DECODE``) on the embedded
SmolLM2, one forward pass of ``rows`` sequences, on the engine thread of one ``LocalEngine`` (its OpenMP team,
waiting as the server's does unless ``OMP_WAIT_POLICY`` is set).

Every row holds the same chat prompt, prefilled once; each row count runs ``--steps`` decode steps after two uncounted
ones, in rounds whose order is reversed every other round (ABBA), and the median milliseconds a step over the rounds
is printed with its ratio to one row's and the load average: what each sequence of a step costs the others in it
(the default of ``BATCH_ROWS_BESIDE_INTERACTIVE`` rests on it). The prefill of the prompt alone is timed too.

    .venv/bin/python bench/step_rows.py
    .venv/bin/python bench/step_rows.py --rows 1,2,4,8,16,24 --rounds 8

Results: ``bench/results/step_rows.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.runtime import GOMP_SPINCOUNT  # noqa: E402

if "OMP_WAIT_POLICY" not in os.environ:  # OpenMP's waiting as the server sets it, before torch starts OpenMP
    os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))

import torch  # noqa: E402

from miserver.engines.local.decoding import DEFAULT_DECODE, make_slots  # noqa: E402
from miserver.engines.local.engine import LocalEngine  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID, Settings  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def load() -> float:
    return round(os.getloadavg()[0], 2)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,3,4,5,9,17", help="row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per row count and round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    counts = [int(x) for x in args.rows.split(",")]
    engine = await LocalEngine.start(EMBEDDED_MODEL_ID, cache_dir=Settings().cache_dir, device="cpu")
    model, context = engine.loaded.model, engine.context_length
    cache = await engine.call(lambda _: make_slots(model, context, DEFAULT_DECODE))
    ids = torch.tensor(engine.tokenize_chat([{"role": "user", "content": PROMPT}]), dtype=torch.long)
    start_load = load()

    def run(_: object) -> tuple[dict[int, list[float]], float]:
        with torch.inference_mode():
            prefill = []
            for _ in range(5):
                begun = time.perf_counter()
                logits = cache.prefill(0, ids)
                prefill.append(time.perf_counter() - begun)
            first = int(torch.argmax(logits))
            for slot in range(1, max(counts)):
                cache.prefill(slot, ids)
            times: dict[int, list[float]] = {n: [] for n in counts}
            for round_ in range(args.rounds):
                for n in counts if round_ % 2 == 0 else counts[::-1]:
                    slots, tokens = list(range(n)), [first] * n
                    for _ in range(2):
                        cache.decode(slots, tokens)
                    begun = time.perf_counter()
                    for _ in range(args.steps):
                        cache.decode(slots, tokens)
                    times[n].append((time.perf_counter() - begun) / args.steps)
            return times, statistics.median(prefill)

    times, prefill = await engine.call(run)
    await engine.close()
    one = statistics.median(times[counts[0]])
    report: dict[str, Any] = {"prompt_tokens": len(ids), "prefill_ms": round(prefill * 1000, 2), "steps": []}
    for n in counts:
        ms = statistics.median(times[n]) * 1000
        report["steps"].append({"rows": n, "ms": round(ms, 2), "x_first": round(ms / (one * 1000), 2)})
        print(f"{n:3d} rows: {ms:6.2f} ms a step, {ms / (one * 1000):.2f}x {counts[0]}")
    report["load"] = [start_load, load()]
    print(f"prefill of the {len(ids)}-token prompt alone: {prefill * 1000:.1f} ms; load {report['load']}")
    out = ROOT / "bench" / "results" / "step_rows.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    asyncio.run(main())
