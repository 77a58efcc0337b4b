"""The next short request after a client hung up, on the real SmolLM2: it should wait at most one decode step more
than on an idle server.

One server (embedded model, SQLite in a temp dir). Rounds of ABAB: (A) a 1-token chat on the idle server; (B) a
``--long``-token chat sent on a raw connection, the connection closed as soon as the engine is generating it (seen on
``miserver_engine_generated_tokens``), then the same 1-token chat. Prints each phase's mean latency, the ratio B/A,
one decode step of this machine (from a full long request: its time over its tokens), the goal (B <= A + one decode
step, on average), the tokens the abandoned requests made, and the load average before and after. Writes
``bench/results/client_gone.json``.

Usage: ``.venv/bin/python bench/client_gone.py [--rounds 3] [--long 300]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402

MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def generated(http: httpx.Client) -> int:
    m = re.search(r"^miserver_engine_generated_tokens (\d+(?:\.\d+)?)", http.get("/metrics").text, re.M)
    assert m, "no miserver_engine_generated_tokens on /metrics"
    return int(float(m.group(1)))


def short(http: httpx.Client) -> float:
    t0 = time.perf_counter()
    answer = http.post("/v1/chat/completions", json={"model": EMBEDDED_MODEL_ID, "messages": MESSAGES, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - t0


def abandon(server: ServerProcess, http: httpx.Client, long: int) -> None:
    body = json.dumps({"model": EMBEDDED_MODEL_ID, "messages": MESSAGES, "max_tokens": long, "temperature": 0})
    host, port = server.base_url.removeprefix("http://").split(":")
    before = generated(http)
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        wait_for(lambda: generated(http) > before, timeout=120, interval=0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", type=int, default=300)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            model=EMBEDDED_MODEL_ID, database_url=f"sqlite:///{tmp}/bench.db", data_dir=Path(tmp) / "var"
        )
        server.start()
        try:
            http = httpx.Client(base_url=server.base_url, timeout=600)
            for _ in range(2):
                short(http)  # warm up
            t0 = time.perf_counter()
            start = generated(http)
            full = http.post(
                "/v1/chat/completions",
                json={"model": EMBEDDED_MODEL_ID, "messages": MESSAGES, "max_tokens": args.long, "temperature": 0},
            )
            assert full.status_code == 200, full.text
            step = (time.perf_counter() - t0) / max(1, generated(http) - start)
            idle: list[float] = []
            after: list[float] = []
            abandoned_tokens: list[int] = []
            for _ in range(args.rounds):
                idle.append(short(http))
                before = generated(http)
                abandon(server, http, args.long)
                after.append(short(http))
                abandoned_tokens.append(generated(http) - before)
                idle.append(short(http))
                before = generated(http)
                abandon(server, http, args.long)
                after.append(short(http))
                abandoned_tokens.append(generated(http) - before)
        finally:
            server.stop()
    a, b = statistics.mean(idle), statistics.mean(after)
    result: dict[str, Any] = {
        "date": datetime.datetime.now(tz=datetime.UTC).isoformat(timespec="seconds"),
        "rounds": args.rounds,
        "long_max_tokens": args.long,
        "idle_s": idle,
        "after_hang_up_s": after,
        "mean_idle_s": a,
        "mean_after_s": b,
        "ratio": b / a,
        "decode_step_s": step,
        "goal_met": b <= a + step,
        "abandoned_tokens": abandoned_tokens,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    print(f"1-token chat, idle:             mean {a:.3f} s over {len(idle)}")
    print(f"1-token chat after a hang-up:   mean {b:.3f} s over {len(after)}  (ratio {b / a:.2f})")
    print(f"one decode step:                {step * 1000:.0f} ms (a {args.long}-token chat: time / tokens)")
    print(f"goal (after <= idle + 1 step):  {'met' if result['goal_met'] else 'NOT met'}")
    print(f"tokens the abandoned requests made (of {args.long} each): {abandoned_tokens}")  # a 1-token chat is a
    # scoring pass, which generates no token: the count is the abandoned request's alone
    print(f"load average before / after:    {load_before} / {result['load_after']}")
    out = ROOT / "bench" / "results" / "client_gone.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
