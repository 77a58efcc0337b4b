"""Benchmark (issue 13, "Measured"): what accounts cost on the batch path, and whether the ledger survives kill -9.

1. **Overhead.** Two servers on the same model, one without keys or prices (``off``: the embedded default) and one
   with an API key and a price table (``on``: every request authenticated, every row's usage record and balance
   charge written in the transaction that records it). The same ``--rows`` rows run as batches, one batch at a time,
   in ABBA order over ``--rounds`` rounds (off, on, on, off for 2), after an untimed warm-up batch on each; a batch
   is timed client side from ``batches.create`` to the poll that sees it terminal. Prints rows/s of each and the ratio
   on/off (the issue's goal: >= 0.97), and checks that the ``on`` server wrote exactly one usage record per row.
2. **Ledger integrity.** A ``--ledger-rows`` batch of a key with a balance on a server with prices, the server killed
   with SIGKILL ``--kills`` times at random points and restarted; once the batch completes, the usage records of the
   batch are counted and summed straight from the database, and compared with the rows recorded (the output lines)
   and their costs recomputed from each line's usage, and the key's stored balance with its credits minus charges.

Writes ``bench/results/accounts.json`` (git-ignored).

Examples::

    .venv/bin/python bench/accounts.py                      # the tests' tiny random model, 200 rows, 2 rounds
    .venv/bin/python bench/accounts.py --postgres postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.protocol.batches import TERMINAL  # noqa: E402
from miserver.store import Store  # noqa: E402
from miserver.store import keys as store_keys  # noqa: E402
from miserver.store import usage as store_usage  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "accounts.json"
#: Realtime micro-units per million tokens; the batch pays half: 1 per input token, 2 per output token.
PRICES = {"currency": "USD", "batch_discount": 0.5, "models": {"tiny": {"input": 2_000_000, "output": 4_000_000}}}
ENV = {"BATCH_POLL_SECONDS": "0.2"}


def rows(n: int, max_tokens: int) -> bytes:
    lines = (
        {
            "custom_id": f"row-{i:04d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"Item {i}: describe it briefly"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(n)
    )
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def run_batch(client: openai.OpenAI, data: bytes, poll: float) -> tuple[float, Any]:
    """Upload ``data``, create a batch, and poll to its end; ``(seconds from create to terminal, batch)``."""
    uploaded = client.files.create(file=("rows.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    started = time.perf_counter()
    while batch.status not in TERMINAL:
        time.sleep(poll)
        batch = client.batches.retrieve(batch.id)
    return time.perf_counter() - started, batch


def make_key(base_url: str, caller: str | None, **spec: Any) -> dict[str, Any]:
    """``POST /api/keys`` as ``caller`` (None: the server is still open)."""
    headers = {"Authorization": f"Bearer {caller}"} if caller else {}
    answer = httpx.post(base_url + "/api/keys", json=spec, headers=headers, timeout=60)
    answer.raise_for_status()
    made: dict[str, Any] = answer.json()
    return made


def overhead(args: argparse.Namespace, model_dir: Path, tmp: Path, prices: Path) -> dict[str, Any]:
    def server(name: str, env: dict[str, str]) -> ServerProcess:
        url = None if args.postgres is None else args.postgres
        if url is not None:
            url = _fresh_pg(url, name)
        return ServerProcess(
            model=str(model_dir), served_model_name="tiny", database_url=url, data_dir=tmp / name, env={**ENV, **env}
        ).start()

    off = server("off", {})
    on = server("on", {"MISERVER_PRICES_FILE": str(prices)})
    try:
        admin = make_key(on.base_url, None, name="admin", admin=True)["key"]
        user = make_key(on.base_url, admin, name="bench", balance=10**12)
        clients = {"off": off.client(), "on": on.client(api_key=user["key"])}
        data = rows(args.rows, args.max_tokens)
        for client in clients.values():  # untimed warm-up: model caches, the database's first pages
            run_batch(client, rows(args.warmup_rows, args.max_tokens), args.poll_seconds)
        order = ["off", "on", "on", "off"] * (args.rounds // 2) + (["off", "on"] if args.rounds % 2 else [])
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for which in order:
            seconds, batch = run_batch(clients[which], data, args.poll_seconds)
            assert batch.status == "completed", batch
            rates[which].append(args.rows / seconds)
            print(f"  {which:>3}: {args.rows / seconds:8.1f} rows/s ({seconds:.2f} s)")
        usage = httpx.get(
            on.base_url + "/api/usage", params={"kind": "batch"}, headers={"Authorization": f"Bearer {user['key']}"}
        ).json()
        records = sum(item["requests"] for item in usage["data"])
        expected = args.rows * (len(rates["on"])) + args.warmup_rows
        assert records == expected, f"usage records {records} != rows run {expected}"
    finally:
        off.stop()
        on.stop()
    mean_off, mean_on = statistics.mean(rates["off"]), statistics.mean(rates["on"])
    return {
        "rows": args.rows,
        "order": order,
        "rows_per_second": rates,
        "mean_off": mean_off,
        "mean_on": mean_on,
        "ratio_on_off": mean_on / mean_off,
        "usage_records_on": records,
    }


#: Databases this run made on the PostgreSQL server: ``(admin URL, name)``, dropped at the end.
MADE: list[tuple[str, str]] = []


def _fresh_pg(url: str, name: str) -> str:
    """A new database ``<db>_acct_<name>_<random>`` on the server of ``url`` (dropped by :func:`_drop_made`)."""
    import secrets

    import psycopg

    base, db = url.rsplit("/", 1)
    fresh = f"{db}_acct_{name}_{secrets.token_hex(3)}"
    admin = base.replace("postgresql+psycopg://", "postgresql://") + "/" + db
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{fresh}"')
    MADE.append((admin, fresh))
    return f"{base}/{fresh}"


def _drop_made() -> None:
    import psycopg

    for admin, name in MADE:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def ledger(args: argparse.Namespace, model_dir: Path, tmp: Path, prices: Path) -> dict[str, Any]:
    root = tmp / "ledger"
    url = _fresh_pg(args.postgres, "ledger") if args.postgres else f"sqlite:///{root / 'miserver.db'}"
    env = {**ENV, "MISERVER_PRICES_FILE": str(prices)}

    def start() -> ServerProcess:
        return ServerProcess(
            model=str(model_dir), served_model_name="tiny", database_url=url, data_dir=root / "var", env=env
        ).start()

    opening = 10_000_000
    current = start()
    admin = make_key(current.base_url, None, name="admin", admin=True)["key"]
    made = make_key(current.base_url, admin, name="ledger", balance=opening)
    client = current.client(api_key=made["key"])
    uploaded = client.files.create(file=("rows.jsonl", rows(args.ledger_rows, 4)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    points = sorted(random.Random(13).sample(range(20, args.ledger_rows - 20), args.kills))
    try:
        for point in points:
            c = current.client(api_key=made["key"])
            wait_for(lambda c=c, p=point: (c.batches.retrieve(batch.id).request_counts.completed or 0) >= p, 600)
            current.kill9()
            print(f"  killed at {point}+ rows")
            current = start()
        client = current.client(api_key=made["key"])
        done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in TERMINAL and b, 600)
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    finally:
        current.stop()
    expected_cost = sum(
        x["response"]["body"]["usage"]["prompt_tokens"] + 2 * x["response"]["body"]["usage"]["completion_tokens"]
        for x in out
    )

    async def audit() -> tuple[store_keys.Ledger, tuple[int, int]]:
        store = await Store.open(url)
        try:
            async with store.read() as conn:
                return await store_keys.ledger(conn, made["id"]), await store_usage.batch_charges(conn, batch.id)
        finally:
            await store.close()

    account, (records, cost) = asyncio.run(audit())
    result = {
        "rows": args.ledger_rows,
        "kills": points,
        "status": done.status,
        "recorded_successes": len(out),
        "usage_records": records,
        "charged": cost,
        "recomputed_from_output": expected_cost,
        "credits": account.credits,
        "charges_all": account.charges,
        "balance": account.balance,
        "ledger_consistent": account.consistent,
        "exact": records == len(out) == args.ledger_rows and cost == expected_cost and account.consistent,
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200, help="rows per timed batch (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=2, help="output tokens per row (default: %(default)s)")
    parser.add_argument("--warmup-rows", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--ledger-rows", type=int, default=300, help="(default: %(default)s)")
    parser.add_argument("--kills", type=int, default=3, help="kill -9 during the ledger batch (default: %(default)s)")
    parser.add_argument("--postgres", default=None, help="a PostgreSQL URL (new databases are made on its server)")
    parser.add_argument("--skip-ledger", action="store_true")
    parser.add_argument("--poll-seconds", type=float, default=0.1, help="(default: %(default)s)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="(default: %(default)s)")
    args = parser.parse_args()

    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="miserver-bench-accounts-") as name, contextlib.ExitStack() as cleanup:
        cleanup.callback(_drop_made)
        tmp = Path(name)
        model_dir = build_tiny_model(tmp / "tiny-model")
        prices = tmp / "prices.json"
        prices.write_text(json.dumps(PRICES))
        print(f"overhead: {args.rows} rows, ABBA x {args.rounds} rounds")
        over = overhead(args, model_dir, tmp, prices)
        print(
            f"off {over['mean_off']:.1f} rows/s, on {over['mean_on']:.1f} rows/s: ratio on/off "
            f"{over['ratio_on_off']:.3f} (goal >= 0.97); usage records {over['usage_records_on']}"
        )
        led = None
        if not args.skip_ledger:
            print(f"ledger: {args.ledger_rows} rows, {args.kills} x kill -9")
            led = ledger(args, model_dir, tmp, prices)
            print(
                f"recorded successes {led['recorded_successes']}, usage records {led['usage_records']}, charged "
                f"{led['charged']} (recomputed {led['recomputed_from_output']}), ledger consistent "
                f"{led['ledger_consistent']}: exact {led['exact']}"
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "database": "postgresql" if args.postgres else "sqlite",
                "overhead": over,
                "ledger": led,
            },
            indent=2,
        )
    )
    return 0 if (led is None or led["exact"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
