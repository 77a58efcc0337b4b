"""Interactive latency with and without a running batch (issue 4's measurement), on the real SmolLM2.

One server (embedded model, SQLite in a temp dir). Short chat requests (max_tokens 8), one after another:
first with no batch running, then while a 200-row AG News batch runs. Prints p50/p95 of both, the time of one
chunk (``BATCH_CHUNK_ROWS`` x the batch's seconds per row), and the goal: p95 while the batch runs <= p95 idle +
one chunk. Writes ``bench/results/interactive_latency.json``.

Usage: ``.venv/bin/python bench/interactive_latency.py [--requests 20] [--rows 200]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID, Settings  # noqa: E402
from tests.support.agnews import agnews_rows  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 plus 3?",
    "Say hello in Spanish.",
    "What do bees make?",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ask(client, i: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    client.chat.completions.create(
        model=EMBEDDED_MODEL_ID,
        messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        max_tokens=8,
        temperature=0,
    )
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    chunk_rows = Settings().batch_chunk_rows
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            model=EMBEDDED_MODEL_ID, database_url=f"sqlite:///{tmp}/bench.db", data_dir=Path(tmp) / "var"
        )
        server.start()
        try:
            client = server.client()
            for i in range(3):
                ask(client, i)  # warm up
            idle = [ask(client, i) for i in range(args.requests)]

            lines = "".join(
                json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
                for cid, body, _ in agnews_rows(args.rows)
            ).encode()
            uploaded = client.files.create(file=("agnews.jsonl", lines), purpose="batch")
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_for(
                lambda: (
                    (counts := client.batches.retrieve(batch.id).request_counts) is not None and counts.completed >= 2
                ),
                timeout=600,
            )
            started = time.perf_counter()
            start_done = client.batches.retrieve(batch.id).request_counts.completed  # type: ignore[union-attr]
            busy = []
            for i in range(args.requests):
                time.sleep(rng.uniform(0.0, 1.0))  # arrive at random points of the batch's chunks
                busy.append(ask(client, i))
            during = client.batches.retrieve(batch.id)
            assert during.status == "in_progress", "the batch ended before the measurement did: use more --rows"
            done = wait_for(
                lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=1800, interval=0.2
            )
            elapsed = time.perf_counter() - started
        finally:
            server.stop()
    rows_run = done.request_counts.completed - start_done  # type: ignore[union-attr]
    row_s = elapsed / max(rows_run, 1)  # includes the interactive requests served meanwhile: an upper bound
    chunk_s = chunk_rows * row_s
    result = {
        "date": datetime.date.today().isoformat(),
        "requests": args.requests,
        "idle_p50_s": statistics.median(idle),
        "idle_p95_s": percentile(idle, 0.95),
        "batch_p50_s": statistics.median(busy),
        "batch_p95_s": percentile(busy, 0.95),
        "batch_row_s": row_s,
        "chunk_rows": chunk_rows,
        "chunk_s": chunk_s,
    }
    result["goal_met"] = result["batch_p95_s"] <= result["idle_p95_s"] + chunk_s
    print(f"idle:          p50 {result['idle_p50_s']:.3f} s  p95 {result['idle_p95_s']:.3f} s")
    print(f"batch running: p50 {result['batch_p50_s']:.3f} s  p95 {result['batch_p95_s']:.3f} s")
    print(f"one chunk: {chunk_rows} rows x {row_s:.3f} s = {chunk_s:.3f} s")
    bound = result["idle_p95_s"] + chunk_s
    print(f"goal p95(batch) <= p95(idle) + chunk: {result['batch_p95_s']:.3f} <= {bound:.3f} -> {result['goal_met']}")
    out = ROOT / "bench" / "results" / "interactive_latency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
