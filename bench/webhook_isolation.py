"""How late one endpoint's webhook arrives while another endpoint never answers (goal: within 2 s of completion).

One server (the tiny test model, SQLite in a temp dir, ``BATCH_POLL_SECONDS`` 0.2). Two webhook endpoints on
``batch.completed``, real HTTP servers in this process: X holds every request open (it never answers; each attempt
ends at the delivery timeout) and is registered first, so its events come first in the outbox; Y answers at once.
``--batches`` small batches run one after another; for each, Y's delay is the time from the moment a poll (every
0.05 s) sees the batch ``completed`` to Y's receipt of its event. Prints each delay, the mean and the worst, the goal,
and the load average before and after. Writes ``bench/results/webhook_isolation.json``.

Usage: ``.venv/bin/python bench/webhook_isolation.py [--batches 4]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import wait_for  # noqa: E402
from tests.support.batches import chat_body, jsonl, line  # noqa: E402
from tests.support.receiver import Receiver  # noqa: E402
from tests.support.server import tiny_server_process  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402

ENV = {"MISERVER_WEBHOOK_ALLOW_PRIVATE": "1", "BATCH_POLL_SECONDS": "0.2"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    load_before = os.getloadavg()
    delays: list[float] = []
    release = threading.Event()
    with tempfile.TemporaryDirectory() as tmp, Receiver(hold=release) as x, Receiver() as y:
        model = build_tiny_model(Path(tmp) / "model")
        with tiny_server_process(model, Path(tmp), env=ENV) as server:
            http = server.http()
            client = server.client()
            for receiver in (x, y):
                hook = http.post("/api/webhooks", json={"url": receiver.url, "events": ["batch.completed"]})
                assert hook.status_code == 200, hook.text
            for n in range(args.batches):
                data = jsonl(line(f"b{n}-{i}", chat_body(f"row {i}", max_tokens=2)) for i in range(2))
                uploaded = client.files.create(file=("rows.jsonl", data), purpose="batch")
                batch = client.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                seen = wait_for(
                    lambda b=batch.id: client.batches.retrieve(b).status == "completed" and time.perf_counter(),
                    timeout=120,
                    interval=0.05,
                )
                wait_for(lambda n=n: len(y.delivered()) > n, timeout=120, interval=0.01)
                delays.append(time.perf_counter() - seen)
            release.set()
    result: dict[str, Any] = {
        "date": datetime.datetime.now(tz=datetime.UTC).isoformat(timespec="seconds"),
        "batches": args.batches,
        "y_delay_s": delays,
        "mean_s": statistics.mean(delays),
        "worst_s": max(delays),
        "goal_met": max(delays) <= 2.0,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    print(f"Y's delay after each completion (s): {[round(d, 2) for d in delays]}")
    print(f"mean {result['mean_s']:.2f} s, worst {result['worst_s']:.2f} s; goal (worst <= 2 s): ", end="")
    print("met" if result["goal_met"] else "NOT met")
    print(f"load average before / after: {load_before} / {result['load_after']}")
    out = ROOT / "bench" / "results" / "webhook_isolation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
