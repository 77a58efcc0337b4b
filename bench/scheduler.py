"""The resident engine's step scheduler, measured from outside on the real SmolLM2 (one server, SQLite).

1. Eight 32-token greedy chats one after another (their median alone and their sum), then the same 8 sent at once,
   and 16 at once (wall and slowest): goal for 8, wall <= 2x one alone.
2. A 32-row (``--rows``) ``pack: true`` generation batch (``max_tokens`` 96) alone, then again with 12 (``--chats``)
   short chats (``max_tokens`` 8) sent at random moments while it runs: the chats' p50/p95 against the same chats on
   an idle server, and the batch's rows/s with and without the chats. Goals: p95 while the batch runs <= 1.2x idle
   p95; the batch keeps >= 0.9x its rows/s. The two batch runs alternate with the idle chats (idle, batch, batch +
   chats, idle).
3. A client that sends a 300-token chat and hangs up after a second, then a 1-token chat, in pairs (``--drops``, 8
   by default) with the same 1-token chat on the idle server just before: the median of the pairs' differences
   against a one-row decode step measured between the pairs (goal: within idle + one decode step).
4. A 64-token chat sent 4 s into the demo's batch (``examples/topics.jsonl``: 64 rows of about 240 prompt tokens
   and 6 generated), once with ``pack: false`` and once with ``pack: true``, against the same chat on an idle server:
   batch rows that start beside a chat put their prefills into its steps.

5. Where a chat's time goes beside a packed batch: streamed 8-token chats (``--stream-rows``, 48 by default) on an idle
   server, then one after another while the batch runs, each split into its time to the first token (the wait for
   the step in flight and the chat's prefill) and the rest (its decode steps), p50/p90/max against idle.

The load average is printed beside each part. Results: ``bench/results/scheduler.json``.

    .venv/bin/python bench/scheduler.py
    .venv/bin/python bench/scheduler.py --rows 96 --chats 36     # a longer batch: steadier rows/s ratios
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402

MODEL = EMBEDDED_MODEL_ID
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 plus 3?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Name a large animal.",
]


def load() -> float:
    return round(os.getloadavg()[0], 2)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def chat(client: Any, i: int, max_tokens: int) -> float:
    start = time.perf_counter()
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return time.perf_counter() - start


def at_once(client: Any, n: int) -> tuple[float, float]:
    """(wall, slowest) seconds of ``n`` 32-token chats sent together."""
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        times = list(pool.map(lambda i: chat(client, i, 32), range(n)))
    return time.perf_counter() - start, max(times)


def batch_lines(rows: int) -> bytes:
    lines = []
    for i in range(rows):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Write a short story about a {QUESTIONS[i % 6].lower()}"}],
            "max_tokens": 96,
            "temperature": 0,
        }
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def run_batch(client: Any, data: bytes, chats: int, rng: random.Random) -> tuple[float, list[float]]:
    """Seconds the packed batch took from its first recorded row to completion, and the latencies of ``chats``
    short chats sent at random moments meanwhile."""
    uploaded = client.files.create(file=("gen.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", extra_body={"pack": True}
    )
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", timeout=600, interval=0.05)
    start = time.perf_counter()
    latencies: list[float] = []

    def interactive() -> None:
        for i in range(chats):
            time.sleep(rng.uniform(0.5, 3.0))
            latencies.append(chat(client, i, 8))

    thread = threading.Thread(target=interactive)
    thread.start()
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
        timeout=3600,
        interval=0.1,
    )
    elapsed = time.perf_counter() - start
    thread.join()
    assert done.status == "completed" and done.request_counts.completed == len(data.splitlines()), done
    return elapsed, latencies


def hang_up(server: ServerProcess, max_tokens: int) -> None:
    """Send a chat on a raw connection, read until the server has begun answering (its headers are not sent before
    the answer is done for a non-streamed request, so wait a fixed second of generation), then close."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens}
    ).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(1.0)  # a client giving up after a second: not an ordering of the server's work


def prefill_heavy(client: Any) -> dict[str, Any]:
    """Part 4: the 64-token chat idle (twice, the median) and 4 s into the demo's batch, unpacked then packed."""

    def essay() -> float:
        start = time.perf_counter()
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write a long essay about bees."}],
            max_tokens=64,
            temperature=0,
        )
        return time.perf_counter() - start

    def during(pack: bool) -> float:
        data = (ROOT / "examples" / "topics.jsonl").read_bytes()
        uploaded = client.files.create(file=("topics.jsonl", data), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"pack": pack},
        )
        wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", timeout=600, interval=0.05)
        time.sleep(4.0)  # the batch well under way: a moment in its run, not an ordering of the server's work
        seconds = essay()
        done = wait_for(
            lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
            timeout=3600,
            interval=0.2,
        )
        assert done.status == "completed", done
        return seconds

    idle = statistics.median([essay(), essay()])
    out: dict[str, Any] = {"idle_s": round(idle, 3)}
    for pack in (False, True):
        seconds = during(pack)
        out["packed" if pack else "unpacked"] = {"during_s": round(seconds, 3), "x_idle": round(seconds / idle, 2)}
    out["load"] = load()
    return out


def part_chats(client: Any) -> dict[str, Any]:
    """Part 1: the 8 chats one after another, then 8 and 16 at once."""
    each = [chat(client, i, 32) for i in range(8)]  # the same 8 chats, one after another
    alone, serial = statistics.median(each), sum(each)
    wall8, slow8 = at_once(client, 8)
    wall16, slow16 = at_once(client, 16)
    out = {
        "alone_median_s": round(alone, 3),
        "one_after_another_s": round(serial, 3),
        "eight": {
            "wall_s": round(wall8, 3),
            "slowest_s": round(slow8, 3),
            "x_alone": round(wall8 / alone, 2),
            "x_one_after_another": round(wall8 / serial, 2),
        },
        "sixteen": {"wall_s": round(wall16, 3), "slowest_s": round(slow16, 3)},
        "load": load(),
    }
    print(
        f"the 8 chats one after another: median {alone:.2f} s, {serial:.2f} s in all; 8 at once wall "
        f"{wall8:.2f} s (slowest {slow8:.2f}, {wall8 / alone:.2f}x the median alone, {wall8 / serial:.2f}x one "
        f"after another); 16 at once wall {wall16:.2f} s (slowest {slow16:.2f}); load {load()}"
    )
    return out


def part_batch(client: Any, rows: int, chats: int, rng: random.Random) -> dict[str, Any]:
    """Part 2: the packed batch alone and with chats, between idle chats."""
    data = batch_lines(rows)
    idle_a = [chat(client, i, 8) for i in range(12)]
    plain_s, _ = run_batch(client, data, 0, rng)
    mixed_s, busy = run_batch(client, data, chats, rng)
    idle_b = [chat(client, i, 8) for i in range(12)]
    idle = idle_a + idle_b
    out = {
        "rows": rows,
        "chats": chats,
        "rows_s_alone": round(rows / plain_s, 3),
        "rows_s_with_chats": round(rows / mixed_s, 3),
        "rows_s_ratio": round(plain_s / mixed_s, 3),
        "idle_p50_s": round(statistics.median(idle), 3),
        "idle_p95_s": round(percentile(idle, 0.95), 3),
        "busy_p50_s": round(statistics.median(busy), 3),
        "busy_p95_s": round(percentile(busy, 0.95), 3),
        "p95_ratio": round(percentile(busy, 0.95) / percentile(idle, 0.95), 2),
        "load": load(),
    }
    b = out
    print(
        f"packed {rows}-row batch: {b['rows_s_alone']} rows/s alone, {b['rows_s_with_chats']} with {chats} "
        "chats "
        f"(x{b['rows_s_ratio']}); chats p50/p95 idle {b['idle_p50_s']}/{b['idle_p95_s']} s, during the batch "
        f"{b['busy_p50_s']}/{b['busy_p95_s']} s (p95 x{b['p95_ratio']}); load {load()}"
    )
    return out


def decode_step_s(client: Any) -> float:
    """Seconds a one-row decode step takes now: a streamed 64-token chat's time between its first and last content
    chunks over the chunks between them."""
    times = []
    for event in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=64,
        temperature=0,
        stream=True,
    ):
        if event.choices and event.choices[0].delta.content:
            times.append(time.perf_counter())
    return (times[-1] - times[0]) / max(1, len(times) - 1)


def part_hang_up(server: ServerProcess, client: Any, pairs: int) -> dict[str, Any]:
    """Part 3: ``pairs`` pairs, each a 1-token chat on the idle server, then a 300-token chat dropped after a second
    and the same 1-token chat right after it; the median of the pairs' differences against one decode step measured
    between the pairs (one request a side swings by tens of milliseconds, so the pairs are compared side by side)."""
    idle, after, steps = [], [], []
    for i in range(pairs):
        idle.append(chat(client, i, 1))
        hang_up(server, 300)
        after.append(chat(client, i, 1))
        steps.append(decode_step_s(client))
    extra = statistics.median(b - a for a, b in zip(idle, after))
    step = statistics.median(steps)
    out = {
        "pairs": pairs,
        "idle_1_token_s": round(statistics.median(idle), 3),
        "after_s": round(statistics.median(after), 3),
        "extra_median_s": round(extra, 4),
        "decode_step_s": round(step, 4),
        "extra_in_steps": round(extra / step, 2),
        "idle_each_s": [round(t, 3) for t in idle],
        "after_each_s": [round(t, 3) for t in after],
        "load": load(),
    }
    print(
        f"1-token chat idle {out['idle_1_token_s']:.3f} s, right after a dropped 300-token chat {out['after_s']:.3f} s "
        f"(medians of {pairs}); the pairs' median difference {extra * 1000:+.1f} ms against a decode step of "
        f"{step * 1000:.1f} ms ({out['extra_in_steps']} steps; goal <= 1); load {out['load']}"
    )
    return out


def streamed(client: Any, i: int) -> tuple[float, float]:
    """Seconds to the first content chunk of a streamed 8-token chat, and to its end."""
    start = time.perf_counter()
    first = None
    for event in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        max_tokens=8,
        temperature=0,
        stream=True,
    ):
        if first is None and event.choices and event.choices[0].delta.content:
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    return (total if first is None else first), total


def part_first_token(client: Any, rows: int) -> dict[str, Any]:
    """Part 5: streamed chats idle, then one after another (0.1-0.6 s apart) while a packed batch runs."""
    idle = [streamed(client, i) for i in range(16)]
    uploaded = client.files.create(file=("gen.jsonl", batch_lines(rows)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", extra_body={"pack": True}
    )
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", timeout=600, interval=0.05)
    rng = random.Random(3)
    busy: list[tuple[float, float]] = []
    while client.batches.retrieve(batch.id).status == "in_progress":
        time.sleep(rng.uniform(0.1, 0.6))  # the moments the chats are sent, not an ordering of the server's work
        busy.append(streamed(client, len(busy)))
    wait_for(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), timeout=3600, interval=0.2)

    def spread(values: list[float]) -> dict[str, float]:
        return {
            "p50_s": round(percentile(values, 0.5), 3),
            "p90_s": round(percentile(values, 0.9), 3),
            "max_s": round(max(values), 3),
        }

    out: dict[str, Any] = {"rows": rows, "chats_during": len(busy)}
    for name, chats in (("idle", idle), ("during", busy)):
        out[name] = {
            "first_token": spread([f for f, _ in chats]),
            "rest": spread([t - f for f, t in chats]),
        }
    out["load"] = load()
    i, d = out["idle"], out["during"]
    print(
        f"streamed 8-token chats: first token p50/p90/max idle {i['first_token']['p50_s']}/{i['first_token']['p90_s']}/"
        f"{i['first_token']['max_s']} s, beside the {rows}-row batch {d['first_token']['p50_s']}/"
        f"{d['first_token']['p90_s']}/{d['first_token']['max_s']} s ({len(busy)} chats); the rest p50 idle "
        f"{i['rest']['p50_s']} s, beside the batch {d['rest']['p50_s']} s; load {out['load']}"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="rows of the packed generation batch")
    parser.add_argument("--chats", type=int, default=12, help="short chats sent while it runs")
    parser.add_argument(
        "--parts", default="1,2,3,4,5", help="the parts to run, comma-separated (the module's numbering)"
    )
    parser.add_argument("--drops", type=int, default=8, help="part 3's pairs of a dropped chat and a 1-token one")
    parser.add_argument("--stream-rows", type=int, default=48, help="rows of part 5's packed batch")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    rows, chats = args.rows, args.chats
    rng = random.Random(7)
    report: dict[str, Any] = {"date": datetime.date.today().isoformat()}
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(model=MODEL, database_url=f"sqlite:///{tmp}/bench.db", data_dir=Path(tmp) / "var")
        server.start()
        try:
            client = server.client(timeout=600)
            for i in range(2):
                chat(client, i, 32)  # warm up
            if "1" in parts:
                report["chats"] = part_chats(client)
            if "2" in parts:
                report["packed_batch"] = part_batch(client, rows, chats, rng)
            if "3" in parts:
                report["hang_up"] = part_hang_up(server, client, args.drops)
            if "5" in parts:
                report["first_token"] = part_first_token(client, args.stream_rows)
            if "4" in parts:
                report["prefill_heavy"] = heavy = prefill_heavy(client)
                print(
                    f"64-token chat idle {heavy['idle_s']} s; 4 s into the demo's batch: unpacked "
                    f"{heavy['unpacked']['during_s']} s (x{heavy['unpacked']['x_idle']}), packed "
                    f"{heavy['packed']['during_s']} s (x{heavy['packed']['x_idle']}); load {heavy['load']}"
                )
        finally:
            server.stop()
    out = ROOT / "bench" / "results" / "scheduler.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
