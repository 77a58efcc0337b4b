"""Benchmark: fair share across two ``miserver worker`` processes on one PostgreSQL.

Two tenants (API keys): the large one with a ``--large-rows`` (1,000) row batch, the small one with ``--small-batches``
(10) batches of ``--small-rows`` (10) rows. Two real ``miserver worker`` processes (runner and resident engine, no
HTTP) on a fresh PostgreSQL database, the tests' tiny random Llama (built in a temporary directory), chat rows of
``--max-tokens`` (4) greedy tokens, ``BATCH_CHUNK_ROWS`` 8. The batches are written to the database directly (as a
server's create would: the file, then the batch in ``validating``), so no third runner takes part.

The small tenant's finish time is the time from its batches' creation to the last one's end (polled every 0.1 s).
It is measured alone and beside the large tenant's batch (created first; the small batches come once it has recorded
16 rows; it is cancelled after, and ends before the next measurement), in the order alone, beside, alone, beside
(``--pairs`` pairs, after one uncounted warm-up alone) in one run, with the load average before each measurement.
Prints each pair's ratio (beside over alone; the goal: at most 2x) and the large tenant's rows recorded meanwhile
(fair: about the small tenant's rows, less its head start), and writes the numbers to
``bench/results/fair_share_workers.json`` (git-ignored). PostgreSQL on 127.0.0.1:5432 with trust authentication
(``MISERVER_TEST_PG`` overrides the server URL). Example::

    nice .venv/bin/python bench/fair_share_workers.py
    nice .venv/bin/python bench/fair_share_workers.py --pairs 1 --large-rows 400
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.clock import now  # noqa: E402
from miserver.ids import ordered_id  # noqa: E402
from miserver.process import WorkerProcess  # noqa: E402
from miserver.store import Store  # noqa: E402
from miserver.store import batches as store_batches  # noqa: E402
from miserver.store import files as store_files  # noqa: E402
from miserver.store import keys as store_keys  # noqa: E402
from tests.support.databases import postgres_database  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fair_share_workers.json"
LARGE, SMALL = "key_bench_large", "key_bench_small"
POLL_SECONDS = 0.1
ENV = {"BATCH_CHUNK_ROWS": "8", "BATCH_POLL_SECONDS": "0.2"}


def rows_file(prefix: str, n: int, max_tokens: int) -> bytes:
    lines = []
    for i in range(n):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"{prefix} row {i}: say something"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        lines.append(
            json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


async def add_keys(store: Store) -> None:
    async with store.tx() as conn:
        for key in (LARGE, SMALL):
            await store_keys.insert_key(
                conn,
                key_id=key,
                name=key,
                digest=key.ljust(64, "0"),
                prefix=key[:8],
                admin=False,
                balance=None,
                max_pending_batches=None,
                max_enqueued_tokens=None,
                created_at=now(),
            )


async def create(store: Store, owner: str, data: bytes) -> str:
    """The file and its ``validating`` batch, as ``POST /v1/files`` and ``POST /v1/batches`` write them."""
    file_id, batch_id = ordered_id("file-"), ordered_id("batch_")
    async with store.tx() as conn:
        await store_files.insert_file(
            conn,
            file_id=file_id,
            purpose="batch",
            filename="rows.jsonl",
            created_at=now(),
            expires_at=None,
            chunks=[data],
            owner_key_id=owner,
        )
        await store_batches.insert_batch(
            conn,
            batch_id=batch_id,
            endpoint="/v1/chat/completions",
            input_file_id=file_id,
            completion_window="24h",
            created_at=now(),
            expires_at=now() + 86400,
            metadata=None,
            pack=False,
            output_expires_seconds=None,
            owner_key_id=owner,
            allow_late=True,
        )
    return batch_id


async def batch(store: Store, batch_id: str) -> store_batches.BatchRecord:
    async with store.tx() as conn:
        found = await store_batches.get_batch(conn, batch_id)
    assert found is not None
    return found


async def measure(store: Store, args: argparse.Namespace, *, beside: bool, tag: str) -> dict[str, Any]:
    """One measurement: the small tenant's finish time (seconds), alone or beside the large tenant's batch."""
    load = os.getloadavg()
    large = None
    if beside:
        large = await create(store, LARGE, rows_file(f"{tag}-large", args.large_rows, args.max_tokens))
        while (b := await batch(store, large)).completed + b.failed < 16:
            assert not b.terminal, f"the large batch ended early: {b.status}"
            await asyncio.sleep(POLL_SECONDS)
    started = time.monotonic()
    small = [
        await create(store, SMALL, rows_file(f"{tag}-small{j}", args.small_rows, args.max_tokens))
        for j in range(args.small_batches)
    ]
    ended: dict[str, float] = {}
    while len(ended) < len(small):
        for batch_id in small:
            if batch_id not in ended and (await batch(store, batch_id)).terminal:
                ended[batch_id] = time.monotonic() - started
        await asyncio.sleep(POLL_SECONDS)
    result: dict[str, Any] = {
        "beside_large": beside,
        "small_seconds": max(ended.values()),
        "small_batches_seconds": sorted(ended.values()),
        "load_average_before": load,
        "load_average_after": os.getloadavg(),
    }
    statuses = [(await batch(store, b)).status for b in small]
    assert statuses == ["completed"] * len(small), statuses
    if large is not None:
        b = await batch(store, large)
        result["large_rows_recorded"] = b.completed + b.failed
        async with store.tx() as conn:
            await store_batches.try_transition(conn, large, ("in_progress",), "cancelling", now())
        while not (await batch(store, large)).terminal:
            await asyncio.sleep(POLL_SECONDS)
    return result


async def run(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    store = await Store.open(url)
    try:
        await add_keys(store)
        warm = await measure(store, args, beside=False, tag="warmup")  # each worker's first chunks are slow
        print(f"warm-up (not counted): small tenant alone: {warm['small_seconds']:.1f} s", flush=True)
        results = []
        for pair in range(args.pairs):
            for beside in (False, True):
                r = await measure(store, args, beside=beside, tag=f"p{pair}{'b' if beside else 'a'}")
                results.append(r)
                where = "beside the large tenant" if beside else "alone"
                extra = f", large recorded {r['large_rows_recorded']} rows" if beside else ""
                print(
                    f"pair {pair + 1}: small tenant {where}: {r['small_seconds']:.1f} s "
                    f"(load {r['load_average_before'][0]:.1f}{extra})",
                    flush=True,
                )
        return results
    finally:
        await store.close()


async def migrate(url: str) -> None:
    """Apply the migrations once, before the workers start (each would otherwise race to)."""
    store = await Store.open(url)
    await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large-rows", type=int, default=1000)
    parser.add_argument("--small-batches", type=int, default=10)
    parser.add_argument("--small-rows", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=2, help="alone/beside pairs, measured ABAB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, postgres_database() as url:
        model = build_tiny_model(Path(tmp) / "tiny")
        asyncio.run(migrate(url))
        workers = [
            WorkerProcess(
                model=str(model),
                served_model_name="tiny",
                database_url=url,
                name=f"w{i}",
                data_dir=Path(tmp) / f"w{i}",
                env=ENV,
            )
            for i in (1, 2)
        ]
        try:
            for w in workers:
                w.start()
            results = asyncio.run(run(url, args))
        finally:
            for w in workers:
                w.stop()
    pairs = [(results[i], results[i + 1]) for i in range(0, len(results), 2)]
    ratios = [b["small_seconds"] / a["small_seconds"] for a, b in pairs]
    for i, ((a, b), ratio) in enumerate(zip(pairs, ratios, strict=True)):
        print(
            f"pair {i + 1}: alone {a['small_seconds']:.1f} s, beside {b['small_seconds']:.1f} s: {ratio:.2f}x "
            f"(goal: at most 2x)"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "args": vars(args),
                "measurements": results,
                "ratios": ratios,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
