"""The journey of issue 9, measured: a batch created while another runs waits ``queued``, then runs every row.

For each database (SQLite, and PostgreSQL when reachable) one server on the real embedded model; then ``--tries``
times: create batch A (10 chat rows); once A has recorded its first row, create batch B (4 rows); wait for both. A try
passes when A ends 10/10 completed and B 4/4 completed, with no ``batch_cancelled`` line, and B was seen waiting with
``waiting_reason: queued`` while A ran. Prints and writes ``bench/results/two_batches.json``.

Examples::

    .venv/bin/python bench/two_batches.py                  # 10 tries on SQLite and PostgreSQL
    .venv/bin/python bench/two_batches.py --tries 3 --databases sqlite
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.protocol.batches import TERMINAL  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "two_batches.json"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def batch_file(prefix: str, rows: int) -> bytes:
    lines = []
    for i in range(rows):
        body = {
            "model": EMBEDDED_MODEL_ID,
            "messages": [{"role": "user", "content": f"Say the number {i} in words."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        line = {"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        lines.append(json.dumps(line))
    return ("\n".join(lines) + "\n").encode()


def submit(client: openai.OpenAI, prefix: str, rows: int) -> str:
    uploaded = client.files.create(file=(f"{prefix}.jsonl", batch_file(prefix, rows)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id


def one_try(client: openai.OpenAI, k: int) -> dict[str, Any]:
    a = submit(client, f"a{k}", 10)
    wait_for(lambda: (client.batches.retrieve(a).request_counts or _zero()).completed >= 1, timeout=600)
    b = submit(client, f"b{k}", 4)
    reasons: set[str | None] = set()
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        batch_a, batch_b = client.batches.retrieve(a), client.batches.retrieve(b)
        if batch_a.status == "in_progress" and batch_b.status == "in_progress":
            extension = (batch_b.model_extra or {}).get("millm") or {}
            reasons.add(extension.get("waiting_reason"))
        if batch_a.status in TERMINAL and batch_b.status in TERMINAL:
            break
        time.sleep(0.2)
    cancelled = 0
    for batch in (batch_a, batch_b):
        if batch.error_file_id:
            text = client.files.content(batch.error_file_id).text
            cancelled += sum(1 for x in text.splitlines() if '"batch_cancelled"' in x)
    counts = [
        (x.status, x.request_counts.completed, x.request_counts.failed) for x in (batch_a, batch_b) if x.request_counts
    ]
    ok = counts == [("completed", 10, 0), ("completed", 4, 0)] and cancelled == 0 and "queued" in reasons
    return {
        "try": k,
        "ok": ok,
        "counts": counts,
        "cancelled_lines": cancelled,
        "b_waiting_reasons": sorted(map(str, reasons)),
    }


def _zero() -> Any:
    return type("Zero", (), {"completed": 0})()


def run(database: str, tries: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="miserver-two-batches-") as tmp:
        url = None
        name = f"miserver_bench_{uuid.uuid4().hex[:8]}"
        if database == "postgresql":
            with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
                admin.execute(f"CREATE DATABASE {name}")
            url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        try:
            with ServerProcess(data_dir=Path(tmp) / "var", database_url=url) as server:
                client = server.client()
                results = [one_try(client, k) for k in range(tries)]
        finally:
            if database == "postgresql":
                with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
                    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    passed = sum(r["ok"] for r in results)
    print(f"{database}: B completed 4/4 (queued while A ran) in {passed} tries out of {tries}")
    for r in results:
        if not r["ok"]:
            print(f"  try {r['try']}: {r}")
    return {"database": database, "tries": tries, "passed": passed, "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    args = parser.parse_args()
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "runs": [run(db, args.tries) for db in args.databases],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    return 0 if all(r["passed"] == r["tries"] for r in report["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
