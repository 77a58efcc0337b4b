"""Gateway mode (issue 12), measured: overhead against a direct client, failover, and fleet use.

1. **Overhead.** One ``miserver serve`` upstream on the tiny model (``--model`` for another) and a ``--no-model``
   gateway in front of it with ``max_in_flight`` N. The same ``--rows`` chat rows are sent (A) straight to the
   upstream by a client keeping N requests in flight and (B) as one batch through the gateway, in ABBA order in one
   run (``--rounds`` times over, ABBA ABBA ...: the machine's speed drifts by 10% within minutes); rows/s of each
   phase (B: from ``batches.create`` returning to the poll that sees ``completed``, so upload aside it includes
   validation, every claim and record, and the output file) and the ratio of the mean rows/s, B/A (goal >= 0.95),
   over all rounds and per round.
   Each phase also gives the CPU milliseconds per row of the gateway, the upstream and this client (from
   ``/proc/<pid>/stat``). The upstream's resident model runs on ``--upstream-threads`` torch threads (default 1,
   ``MISERVER_TORCH_THREADS``): with torch's default (one spinning thread per core) the upstream alone keeps both of
   a 2-core machine's cores busy, and the ratio then measures how two processes share two cores; with one thread the
   upstream stands for an engine on its own hardware, the deployment a gateway is for. The batch is watched with a
   poll that comes faster as the batch nears its end (``--poll`` seconds at the end, at most 1 s before), so the
   finish is seen within about ``--poll`` without a poll every ``--poll`` seconds costing the gateway CPU.
2. **Failover.** Two upstreams serving the same model, one killed with SIGKILL once a tenth of the batch is recorded:
   rows lost (never recorded), rows recorded twice (a custom_id seen twice in the output), time to finish.
3. **Fleet use.** An upstream that sleeps ``--delay`` seconds per request (``tests/support/fake_upstream.py``, a real
   HTTP server process): one batch per ``max_in_flight`` in 1, 2, 4, 8, 16; rows/s end to end and in the steady
   state (between a quarter and three quarters of the rows recorded), against the ideal ``max_in_flight / delay``
   and against a direct client at the same concurrency (the durable queue must not serialise what the engine runs
   in parallel).

4. **Ceiling.** An upstream that answers at once (the same small server, no delay) behind a gateway with
   ``max_in_flight`` ``--ceiling-width``: the rows/s one gateway process sustains and its CPU milliseconds per row,
   twice. Here the gateway is the bottleneck, so this is the number its own cost per row decides.

Prints a table and writes ``bench/results/gateway.json``.

Examples::

    .venv/bin/python bench/gateway.py                      # all four, 200 rows, N = 4
    .venv/bin/python bench/gateway.py --only overhead --upstream-threads 0   # torch's default threads upstream
    .venv/bin/python bench/gateway.py --only overhead --upstream-threads 0 --upstream-env OMP_WAIT_POLICY=PASSIVE
    .venv/bin/python bench/gateway.py --only fleet --delay 0.2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.protocol.batches import TERMINAL  # noqa: E402
from tests.support.fake_upstream import FakeUpstream  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gateway.json"
MODEL = "bench-up"
FLEET = (1, 2, 4, 8, 16)


def bodies(rows: int, model: str, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Row {i}: say a word."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for i in range(rows)
    ]


def run_batch(
    client: openai.OpenAI, rows: list[dict[str, Any]], poll: float = 0.1, trace: list[tuple[float, int]] | None = None
) -> tuple[float, Any]:
    """Seconds from create to ``completed`` (upload before the clock starts) and the final batch; ``trace`` collects
    ``(seconds, rows recorded)`` at every poll, each ``poll`` seconds. Untraced, the poll comes faster as the batch
    nears its end: a quarter of the time left at the rate so far, between ``poll`` and 1 s."""
    data = "".join(
        json.dumps({"custom_id": f"r{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
        for i, b in enumerate(rows)
    ).encode()
    uploaded = client.files.create(file=("rows.jsonl", data), purpose="batch")
    started = time.monotonic()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait = poll
    while batch.status not in TERMINAL:
        time.sleep(wait)
        batch = client.batches.retrieve(batch.id)
        elapsed = time.monotonic() - started
        counts = batch.request_counts
        done = counts.completed + counts.failed if counts is not None else 0
        if trace is not None:
            trace.append((elapsed, done))
        left = len(rows) - done
        wait = poll if done == 0 or trace is not None else min(1.0, max(poll, left * elapsed / done / 4))
    return time.monotonic() - started, batch


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (every thread), from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steady_rate(trace: list[tuple[float, int]], rows: int) -> float:
    """Rows/s between the polls that saw a quarter and three quarters of the rows recorded (validation, the first
    claim and the output file left out)."""
    first = next(p for p in trace if p[1] >= rows // 4)
    last = next(p for p in trace if p[1] >= 3 * rows // 4)
    return (last[1] - first[1]) / max(last[0] - first[0], 1e-9)


def run_direct(base_url: str, rows: list[dict[str, Any]], concurrency: int) -> float:
    """Seconds to send every row straight to the upstream with ``concurrency`` requests in flight."""
    clients = [httpx.Client(base_url=base_url, timeout=300) for _ in range(concurrency)]

    def send(k: int) -> None:
        client = clients[k % concurrency]
        for body in rows[k::concurrency]:
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, range(concurrency)))
    seconds = time.monotonic() - started
    for c in clients:
        c.close()
    return seconds


def upstream(
    model_dir: str, root: Path, name: str, threads: int = 0, extra: dict[str, str] | None = None
) -> ServerProcess:
    env = ({"MISERVER_TORCH_THREADS": str(threads)} if threads else {}) | (extra or {})
    return ServerProcess(
        model=model_dir,
        served_model_name=MODEL,
        data_dir=root / name,
        database_url=f"sqlite:///{root / name}.db",
        env=env,
    )


def gateway(root: Path, name: str, entries: list[str], *, quick: bool = True) -> ServerProcess:
    """A ``--no-model`` gateway in front of ``entries``; ``quick``: it polls its batches every 0.2 s and probes its
    upstreams every second (the failover and fleet runs, which watch it react), else the server's defaults (1 s and
    5 s: what the overhead and ceiling runs measure, since each poll and probe costs CPU)."""
    env = {"MISERVER_NO_MODEL": "1", "MISERVER_UPSTREAMS": ",".join(entries)}
    if quick:
        env |= {"BATCH_POLL_SECONDS": "0.2", "MISERVER_UPSTREAM_HEALTH_SECONDS": "1"}
    return ServerProcess(data_dir=root / name, database_url=f"sqlite:///{root / name}.db", env=env)


def overhead(
    model_dir: str,
    root: Path,
    rows: int,
    n: int,
    max_tokens: int,
    threads: int,
    poll: float,
    rounds: int,
    upstream_env: dict[str, str],
) -> dict[str, Any]:
    work = bodies(rows, MODEL, max_tokens)
    with (
        upstream(model_dir, root, "up-overhead", threads, upstream_env) as up,
        gateway(root, "gw-overhead", [f"u={up.base_url};max_in_flight={n}"], quick=False) as gw,
    ):  # noqa: E501
        client = gw.client(timeout=600)
        warm = max(8, rows // 5)  # untimed warm-up of both paths (the upstream's first rows run slower)
        run_direct(up.base_url, work[:warm], n)
        run_batch(client, work[:warm])
        pids = {"gateway": gw.proc.pid, "upstream": up.proc.pid}
        phases = []
        for r in range(1, rounds + 1):
            for kind in ("direct", "gateway", "gateway", "direct"):
                before = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"client": time.process_time()}
                if kind == "direct":
                    seconds = run_direct(up.base_url, work, n)
                else:
                    seconds, batch = run_batch(client, work, poll)
                    assert batch.status == "completed" and batch.request_counts.completed == rows, batch
                after = {name: cpu_seconds(pid) for name, pid in pids.items()} | {"client": time.process_time()}
                cpu = {f"{k}_cpu_ms_per_row": round(1000 * (after[k] - before[k]) / rows, 1) for k in after}
                phases.append(
                    {
                        "round": r,
                        "phase": kind,
                        "seconds": round(seconds, 2),
                        "rows_per_second": round(rows / seconds, 2),
                        **cpu,
                    }
                )
                print(
                    f"  {r} {kind:8s} {seconds:7.2f} s  {rows / seconds:7.2f} rows/s   CPU ms/row: gateway "
                    f"{cpu['gateway_cpu_ms_per_row']:5.1f}, upstream {cpu['upstream_cpu_ms_per_row']:5.1f}, client "
                    f"{cpu['client_cpu_ms_per_row']:4.1f}",
                    flush=True,
                )

    def ratio(of: list[dict[str, Any]]) -> float:
        mean = {k: sum(p["rows_per_second"] for p in of if p["phase"] == k) for k in ("direct", "gateway")}
        return round(mean["gateway"] / mean["direct"], 3)

    per_round = [ratio([p for p in phases if p["round"] == r]) for r in range(1, rounds + 1)]
    return {
        "rows": rows,
        "max_in_flight": n,
        "max_tokens": max_tokens,
        "upstream_torch_threads": threads or "default",
        "upstream_env": upstream_env,
        "poll_seconds": poll,
        "rounds": rounds,
        "phases": phases,
        "ratio_per_round": per_round,
        "ratio": ratio(phases),
    }


def failover(model_dir: str, root: Path, rows: int, n: int, max_tokens: int) -> dict[str, Any]:
    work = bodies(rows, MODEL, max_tokens)
    a, b = upstream(model_dir, root, "up-a"), upstream(model_dir, root, "up-b")
    with (
        a,
        b,
        gateway(root, "gw-failover", [f"a={a.base_url};max_in_flight={n}", f"b={b.base_url};max_in_flight={n}"]) as gw,
    ):  # noqa: E501
        client = gw.client(timeout=600)
        data = "".join(
            json.dumps({"custom_id": f"r{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": x}) + "\n"
            for i, x in enumerate(work)
        ).encode()
        uploaded = client.files.create(file=("rows.jsonl", data), purpose="batch")
        started = time.monotonic()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )  # noqa: E501
        wait_for(lambda: (client.batches.retrieve(batch.id).request_counts.completed or 0) >= rows // 10, 600, 0.05)
        killed_at = time.monotonic() - started
        a.kill9()
        done = wait_for(lambda: (x := client.batches.retrieve(batch.id)).status in TERMINAL and x, 1200, 0.1)
        seconds = time.monotonic() - started
        out = (
            [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
            if done.output_file_id
            else []
        )  # noqa: E501
    seen = Counter(x["custom_id"] for x in out)
    result = {
        "rows": rows,
        "max_in_flight_each": n,
        "status": done.status,
        "killed_after_s": round(killed_at, 2),
        "seconds": round(seconds, 2),
        "completed": done.request_counts.completed,
        "failed": done.request_counts.failed,
        "lost": rows - len(seen),
        "recorded_twice": sum(c - 1 for c in seen.values()),
        "in_order": [x["custom_id"] for x in out] == sorted(seen),
    }
    print(f"  {result}", flush=True)
    return result


def fleet(root: Path, delay: float, seconds_each: float) -> list[dict[str, Any]]:
    fakes = {m: FakeUpstream(model=f"slow{m}", delay=delay) for m in FLEET}
    for f in fakes.values():
        f.start()
    try:
        entries = [f"s{m}={f.base_url};max_in_flight={m}" for m, f in fakes.items()]
        results = []
        with gateway(root, "gw-fleet", entries) as gw:
            client = gw.client(timeout=600)
            run_batch(client, bodies(4, "slow1", 1))  # untimed warm-up
            for m in FLEET:
                rows = max(10, int(seconds_each * m / delay))
                direct = rows / run_direct(fakes[m].base_url, bodies(rows, f"slow{m}", 1), m)
                trace: list[tuple[float, int]] = []
                seconds, batch = run_batch(client, bodies(rows, f"slow{m}", 1), trace=trace)
                assert batch.status == "completed" and batch.request_counts.completed == rows, batch
                rate, ideal, steady = rows / seconds, m / delay, steady_rate(trace, rows)
                results.append(
                    {
                        "max_in_flight": m,
                        "rows": rows,
                        "seconds": round(seconds, 2),
                        "rows_per_second": round(rate, 2),
                        "steady_rows_per_second": round(steady, 2),
                        "ideal": round(ideal, 2),
                        "of_ideal": round(rate / ideal, 3),
                        "steady_of_ideal": round(steady / ideal, 3),
                        "direct_rows_per_second": round(direct, 2),
                        "steady_of_direct": round(steady / direct, 3),
                    }
                )
                print(
                    f"  max_in_flight {m:2d}: {rows:4d} rows {seconds:6.2f} s {rate:6.2f} rows/s "
                    f"({rate / ideal:.0%} of {ideal:.0f}); steady {steady:6.2f} rows/s ({steady / ideal:.0%}); "
                    f"a direct client {direct:6.2f} rows/s",
                    flush=True,
                )
    finally:
        for f in fakes.values():
            f.stop()
    return results


def ceiling(root: Path, rows: int, width: int) -> list[dict[str, Any]]:
    results = []
    with (
        FakeUpstream(model="fast", delay=0) as fast,
        gateway(root, "gw-ceiling", [f"f={fast.base_url};max_in_flight={width}"], quick=False) as gw,
    ):  # noqa: E501
        client = gw.client(timeout=600)
        run_batch(client, bodies(20, "fast", 1))  # untimed warm-up
        for attempt in (1, 2):
            before = cpu_seconds(gw.proc.pid)
            seconds, batch = run_batch(client, bodies(rows, "fast", 1))
            assert batch.status == "completed" and batch.request_counts.completed == rows, batch
            cpu = 1000 * (cpu_seconds(gw.proc.pid) - before) / rows
            results.append(
                {
                    "run": attempt,
                    "rows": rows,
                    "max_in_flight": width,
                    "seconds": round(seconds, 2),
                    "rows_per_second": round(rows / seconds, 1),
                    "gateway_cpu_ms_per_row": round(cpu, 2),
                }
            )
            print(
                f"  run {attempt}: {rows} rows in {seconds:6.2f} s = {rows / seconds:6.1f} rows/s; gateway CPU "
                f"{cpu:5.2f} ms/row",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--n", type=int, default=4, help="max_in_flight and the direct client's concurrency")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="upstream model (default: the tiny test model, built here)")
    parser.add_argument("--delay", type=float, default=0.2, help="the slow upstream's seconds per request")
    parser.add_argument("--fleet-seconds", type=float, default=6.0, help="about how long each fleet batch runs")
    parser.add_argument(
        "--upstream-threads",
        type=int,
        default=1,
        help="torch threads of the overhead upstream's model (0: torch's default, one per core)",
    )
    parser.add_argument("--poll", type=float, default=0.1, help="fastest poll of a batch, seconds (near its end)")
    parser.add_argument("--rounds", type=int, default=3, help="ABBA rounds of the overhead run")
    parser.add_argument(
        "--upstream-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the overhead upstream (e.g. OMP_WAIT_POLICY=PASSIVE)",
    )
    parser.add_argument("--ceiling-rows", type=int, default=1000)
    parser.add_argument("--ceiling-width", type=int, default=16, help="max_in_flight of the ceiling run")
    parser.add_argument("--only", choices=("overhead", "failover", "fleet", "ceiling"), action="append")
    args = parser.parse_args()
    only = set(args.only or ("overhead", "failover", "fleet", "ceiling"))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "command": " ".join(sys.argv),
    }
    with tempfile.TemporaryDirectory(prefix="miserver-bench-gateway-") as tmp:
        root = Path(tmp)
        model_dir = args.model or str(build_tiny_model(root / "tiny"))
        report["model"] = args.model or "tiny (2 layers, 64 wide, SmolLM2 tokenizer)"
        if "overhead" in only:
            threads = args.upstream_threads or "torch's default"
            print(f"overhead: {args.rows} rows, N = {args.n}, ABBA, upstream torch threads: {threads}", flush=True)
            report["overhead"] = overhead(
                model_dir,
                root,
                args.rows,
                args.n,
                args.max_tokens,
                args.upstream_threads,
                args.poll,
                args.rounds,
                dict(item.split("=", 1) for item in args.upstream_env),
            )
            result = report["overhead"]
            print(f"  gateway / direct = {result['ratio']} (per round: {result['ratio_per_round']})", flush=True)
        if "failover" in only:
            print("failover: two upstreams, one killed with SIGKILL at 10%", flush=True)
            report["failover"] = failover(model_dir, root, args.rows, args.n, args.max_tokens)
        if "fleet" in only:
            print(f"fleet use: an upstream sleeping {args.delay} s per request", flush=True)
            report["fleet"] = fleet(root, args.delay, args.fleet_seconds)
        if "ceiling" in only:
            print(f"ceiling: an upstream that answers at once, max_in_flight {args.ceiling_width}", flush=True)
            report["ceiling"] = ceiling(root, args.ceiling_rows, args.ceiling_width)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
