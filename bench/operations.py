"""Benchmark (issue 14): the ETA's accuracy and the fairness of batches sharing the engine, on the real model.

One ``miserver serve`` process on the embedded SmolLM2-135M-Instruct, a fresh SQLite database in a temporary
directory, AG News topic rows (the few-shot chat rows of ``bench/batch_vs_direct.py``, greedy, ``--max-tokens``):

1. ETA: a ``--eta-rows`` (200) row batch alone. When a poll (every 0.5 s) first sees 25% of its rows recorded, the
   batch's ``millm.estimated_completion_at`` is read; the batch's actual end is the poll that sees ``completed``.
   Reports the error ``|estimated - actual|`` in seconds, and relative to the time that was left at 25% (the
   prediction's horizon) and to the whole run. Goal: within 20%.
2. Fairness: a ``--small-rows`` (10) row batch alone (time from create to completed), then a ``--large-rows``
   (1,000) row batch, and once that one has recorded its first rows, the same small batch again; the large one is
   cancelled after. Reports both times and their ratio (goal: at most 2x).

``--tiny`` runs the same on the tests' tiny random Llama (built in a temporary directory; seconds per batch instead
of minutes): it checks the mechanism on a loaded machine, not the real model's numbers.

Writes the numbers with the date to ``bench/results/operations.json`` (git-ignored). Example::

    nice .venv/bin/python bench/operations.py --eta-rows 200 --large-rows 1000 --small-rows 10
    nice .venv/bin/python bench/operations.py --tiny --max-tokens 4
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess  # noqa: E402
from miserver.protocol.batches import TERMINAL  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402
from tests.support.agnews import LABELS, balanced_items, few_shot_messages  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "operations.json"
POLL_SECONDS = 0.5
MODEL = EMBEDDED_MODEL_ID


def rows_file(prefix: str, n: int, max_tokens: int) -> bytes:
    items = balanced_items(-(-n // len(LABELS)) + 1)
    lines = []
    for i in range(n):
        row = items[i % len(items)]
        body = {
            "model": MODEL,
            "messages": few_shot_messages(f"{row['title']}. {row['description']}"),
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        lines.append(
            json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


def create(client: openai.OpenAI, data: bytes) -> Any:
    uploaded = client.files.create(file=("rows.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"millm_allow_late": True},
    )


def wait(client: openai.OpenAI, batch_id: str, done: Any) -> Any:
    while True:
        b = client.batches.retrieve(batch_id)
        if done(b):
            return b
        time.sleep(POLL_SECONDS)


def eta_accuracy(client: openai.OpenAI, rows: int, max_tokens: int) -> dict[str, Any]:
    started = time.time()
    batch = create(client, rows_file("eta", rows, max_tokens))
    quarter = -(-rows // 4)
    at_quarter = wait(client, batch.id, lambda b: b.request_counts.completed + b.request_counts.failed >= quarter)
    seen = time.time()
    estimate = at_quarter.model_extra["millm"]["estimated_completion_at"]
    final = wait(client, batch.id, lambda b: b.status in TERMINAL)
    ended = time.time()
    error = abs(estimate - ended) if estimate is not None else None
    return {
        "rows": rows,
        "max_tokens": max_tokens,
        "status": final.status,
        "recorded_at_quarter": at_quarter.request_counts.completed + at_quarter.request_counts.failed,
        "seconds_total": round(ended - started, 1),
        "seconds_left_at_quarter": round(ended - seen, 1),
        "estimated_completion_at": estimate,
        "actual_completion_at": round(ended, 1),
        "error_seconds": round(error, 1) if error is not None else None,
        "error_of_horizon": round(error / (ended - seen), 3) if error is not None else None,
        "error_of_run": round(error / (ended - started), 3) if error is not None else None,
    }


def time_small(client: openai.OpenAI, rows: int, max_tokens: int, tag: str) -> float:
    started = time.monotonic()
    batch = create(client, rows_file(tag, rows, max_tokens))
    final = wait(client, batch.id, lambda b: b.status in TERMINAL)
    assert final.status == "completed", final.status
    return time.monotonic() - started


def fairness(client: openai.OpenAI, small: int, large: int, max_tokens: int) -> dict[str, Any]:
    alone = time_small(client, small, max_tokens, "alone")
    big = create(client, rows_file("large", large, max_tokens))
    wait(client, big.id, lambda b: b.request_counts.completed >= 8)
    beside = time_small(client, small, max_tokens, "beside")
    progress = client.batches.retrieve(big.id).request_counts.completed
    client.batches.cancel(big.id)
    wait(client, big.id, lambda b: b.status in TERMINAL)
    return {
        "small_rows": small,
        "large_rows": large,
        "seconds_alone": round(alone, 1),
        "seconds_beside_large": round(beside, 1),
        "ratio": round(beside / alone, 2),
        "large_rows_done_when_small_ended": progress,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eta-rows", type=int, default=200)
    parser.add_argument("--small-rows", type=int, default=10)
    parser.add_argument("--large-rows", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--skip-eta", action="store_true")
    parser.add_argument("--skip-fairness", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random model instead of SmolLM2")
    args = parser.parse_args()
    results: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(), "machine": platform.node()}
    global MODEL
    with tempfile.TemporaryDirectory() as tmp:
        extra: dict[str, Any] = {}
        if args.tiny:
            from tests.support.tiny_model import build_tiny_model

            extra = {"model": str(build_tiny_model(Path(tmp) / "tiny")), "served_model_name": "tiny"}
            MODEL = "tiny"
        results["model"] = MODEL
        server = ServerProcess(data_dir=Path(tmp) / "var", database_url=f"sqlite:///{tmp}/bench.db", **extra)
        with server:
            client = server.client()
            if not args.skip_eta:
                results["eta"] = eta_accuracy(client, args.eta_rows, args.max_tokens)
                print(json.dumps(results["eta"]), flush=True)
            if not args.skip_fairness:
                results["fairness"] = fairness(client, args.small_rows, args.large_rows, args.max_tokens)
                print(json.dumps(results["fairness"]), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
