"""Fuzz target (issue 18, item 4): the batch-line generators of ``tests/support/fuzz_lines.py`` against a running
server, for a number of cases or a time, outside the test suite.

Each generated file is uploaded and run as a batch (``/v1/chat/completions``), and each line's body is also sent to
the synchronous route in strict mode. A case is one batch line or one synchronous request. A server error is a 5xx
answer, a batch that does not complete, or an error line with a 5xx status; the first one is printed with its input.

Example (a server on the tiny or the embedded model, serving the name ``tiny``)::

    .venv/bin/miserver serve --port 8000 --model ./tiny-model --served-model-name tiny &
    .venv/bin/python tools/fuzz.py --url http://127.0.0.1:8000 --count 10000

Prints ``cases run``, ``server errors`` and the first failing input; exits 1 when there was a server error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.fuzz_lines import ENDPOINT, Line, batch_file  # noqa: E402

TERMINAL = {"completed", "failed", "expired", "cancelled"}


class Enough(Exception):
    """The count or the time is reached."""


@dataclass
class Tally:
    lines: int = 0
    requests: int = 0
    batches: int = 0
    server_errors: int = 0
    first_failure: str | None = None
    codes: dict[str, int] = field(default_factory=dict)

    @property
    def cases(self) -> int:
        return self.lines + self.requests

    def fault(self, what: str) -> None:
        self.server_errors += 1
        if self.first_failure is None:
            self.first_failure = what


def run_batch(http: httpx.Client, lines: list[Line], tally: Tally, timeout: float) -> None:
    data = b"\n".join(line.raw for line in lines) + b"\n"
    uploaded = http.post("/v1/files", files={"file": ("fuzz.jsonl", data)}, data={"purpose": "batch"})
    if uploaded.status_code >= 500 or uploaded.status_code != 200:
        if uploaded.status_code >= 500:
            tally.fault(f"upload answered {uploaded.status_code}: {uploaded.text[:500]}\ninput: {data[:2000]!r}")
        return
    created = http.post(
        "/v1/batches",
        json={"input_file_id": uploaded.json()["id"], "endpoint": ENDPOINT, "completion_window": "24h"},
    )
    if created.status_code != 200:
        tally.fault(f"batch create answered {created.status_code}: {created.text[:500]}")
        return
    batch_id = created.json()["id"]
    deadline = time.monotonic() + timeout
    while True:
        batch = http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in TERMINAL or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    tally.batches += 1
    tally.lines += len(lines)
    if batch["status"] != "completed":
        tally.fault(f"batch {batch_id} ended {batch['status']}: {batch.get('errors')}\ninput: {data[:4000]!r}")
        return
    if batch.get("error_file_id"):
        content = http.get(f"/v1/files/{batch['error_file_id']}/content").text
        for text in content.splitlines():
            error_line = json.loads(text)
            status = (error_line.get("response") or {}).get("status_code", 0)
            code = (error_line.get("error") or {}).get("code")
            tally.codes[str(code)] = tally.codes.get(str(code), 0) + 1
            if status >= 500:
                tally.fault(f"batch {batch_id} error line {text[:1000]}")


def send_requests(http: httpx.Client, lines: list[Line], tally: Tally) -> None:
    for line in lines:
        body = line.obj.get("body") if line.obj else None
        if not isinstance(body, dict) or body.get("stream") is True:
            continue
        try:
            answer = http.post(ENDPOINT, json=body, headers={"X-miLLM-Strict": "true"})
        except ValueError:  # a body with NaN or a lone surrogate: send the line's own text as the body instead
            raw = line.raw
            answer = http.post(ENDPOINT, content=raw, headers={"content-type": "application/json"})
        tally.requests += 1
        if answer.status_code >= 500:
            tally.fault(f"{ENDPOINT} answered {answer.status_code}: {answer.text[:500]}\nbody: {line.raw[:2000]!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    parser.add_argument("--count", type=int, default=10_000, help="stop after this many cases (lines + requests)")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--lines-per-batch", type=int, default=100, help="lines of each generated batch file")
    args = parser.parse_args()
    tally = Tally()
    started = time.monotonic()
    pending: list[Line] = []

    def enough() -> bool:
        late = args.seconds is not None and time.monotonic() - started > args.seconds
        return late or tally.cases >= args.count

    with httpx.Client(base_url=args.url, timeout=600) as http:

        @settings(
            max_examples=10**9,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(lines=batch_file(min_lines=5, max_lines=20, max_near_limit=0))
        def one_file(lines: list[Line]) -> None:
            offset = len(pending)
            for i, line in enumerate(lines):  # ids unique across the merged file
                cid = line.obj.get("custom_id") if line.obj is not None else None
                if line.obj is not None and isinstance(cid, str) and cid.startswith("row-"):
                    obj = {**line.obj, "custom_id": f"{line.obj['custom_id']}-{offset + i}"}
                    line = Line(json.dumps(obj, ensure_ascii=False).encode(), line.valid, line.mutation, obj)
                pending.append(line)
            if len(pending) >= args.lines_per_batch:
                run_batch(http, pending, tally, timeout=1800)
                send_requests(http, pending, tally)
                pending.clear()
                print(
                    f"{time.monotonic() - started:7.0f} s  cases {tally.cases}  server errors {tally.server_errors}",
                    flush=True,
                )
            if enough():
                raise Enough

        with contextlib.suppress(Enough):
            one_file()
    elapsed = time.monotonic() - started
    print(
        f"cases run: {tally.cases} ({tally.lines} batch lines in {tally.batches} batches, "
        f"{tally.requests} synchronous requests) in {elapsed:.0f} s"
    )
    print(f"server errors: {tally.server_errors}")
    print(f"error codes of refused lines: {json.dumps(dict(sorted(tally.codes.items())))}")
    if tally.first_failure:
        print(f"first failing input:\n{tally.first_failure}")
    return 1 if tally.server_errors else 0


if __name__ == "__main__":
    sys.exit(main())
