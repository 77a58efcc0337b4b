"""Benchmark (issue 16, "Measured"): the console's job list with 1,000 batches, and how soon a recorded row shows in
the browser.

1. **Job list.** 1,000 finished batches (with descriptions, several statuses) are written into a fresh SQLite
   database before a real ``miserver serve`` (the tests' tiny model) starts on it. Then, one after another, ``--loads``
   loads each of: the console's first page (``GET /console/``), a search by description (``?q=``), a status filter,
   and, as the yardstick in the same run, the API's ``GET /v1/batches?limit=25`` (JSON, no HTML). Each load is
   timed by the client on the loopback interface (an upper bound of the server's time: it includes the loopback
   round trip). Prints p50 and p95 per page and the ratio console / API at p95. The issue's goal: p95 < 300 ms.
2. **Progress latency.** A 40-row batch runs while Chromium (Debian's ``/usr/bin/chromium``, through Playwright)
   shows the job list; the page records ``Date.now()`` each time the row's "processed / total" text changes (a
   MutationObserver), and the bench polls ``GET /v1/batches/{id}`` every 10 ms, noting when each count first
   appears. Latency of a count = browser time - first poll that saw it (same machine, same clock; the poll sees a
   row up to one poll interval plus one request late, so this slightly understates). Prints p50/p95/max. Goal: < 1 s.

Writes ``bench/results/console.json`` (git-ignored).

Example::

    .venv/bin/python bench/console.py            # 1,000 batches, 20 loads per page, a 40-row batch in the browser
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miserver.clock import now
from miserver.ids import ordered_id  # noqa: E402
from miserver.store import Store  # noqa: E402
from miserver.store import batches as sb  # noqa: E402
from miserver.store import files as sf  # noqa: E402
from tests.support.batches import chat_body, jsonl, line, submit  # noqa: E402
from tests.support.server import tiny_server_process  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402

STATUSES = ("completed", "failed", "cancelled", "expired")


async def seed(url: str, count: int) -> None:
    """``count`` finished batches (one shared input file) with descriptions, written straight into the store."""
    store = await Store.open(url)
    try:
        file_id = ordered_id("file-")
        async with store.tx() as conn:
            await sf.insert_file(
                conn,
                file_id=file_id,
                purpose="batch",
                filename="in.jsonl",
                created_at=now(),
                expires_at=None,
                chunks=[b"{}\n"],
                owner_key_id=None,
            )
        for start in range(0, count, 100):
            async with store.tx() as conn:
                for i in range(start, min(count, start + 100)):
                    batch_id = ordered_id("batch_")
                    await sb.insert_batch(
                        conn,
                        batch_id=batch_id,
                        endpoint="/v1/chat/completions",
                        input_file_id=file_id,
                        completion_window="24h",
                        created_at=now(),
                        expires_at=now() + 86400,
                        metadata={"description": f"eval run {i} of team {i % 7}"},
                        pack=False,
                        output_expires_seconds=None,
                    )
                    await sb.transition(conn, batch_id, ("validating",), STATUSES[i % len(STATUSES)], now())
    finally:
        await store.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def job_list(base_url: str, loads: int) -> dict[str, Any]:
    pages = {
        "console list": "/console/",
        "console search": "/console/?q=team+3",
        "console status filter": "/console/?status=failed",
        "api list (yardstick)": "/v1/batches?limit=25",
    }
    out: dict[str, Any] = {}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for name, path in pages.items():
            http.get(path).raise_for_status()  # warm-up (and the console's session cookie)
            times = []
            for _ in range(loads):
                started = time.perf_counter()
                answer = http.get(path)
                times.append((time.perf_counter() - started) * 1000)
                answer.raise_for_status()
            out[name] = {"p50_ms": round(statistics.median(times), 1), "p95_ms": round(percentile(times, 0.95), 1)}
    return out


WATCH = """() => {
  window.__changes = [];
  const node = document.querySelector('tr[data-batch-id] [data-field="counts"]');
  const seen = () => window.__changes.push([node.textContent.trim(), Date.now()]);
  new MutationObserver(seen).observe(node, {childList: true, characterData: true, subtree: true});
}"""


def progress_latency(server: Any, rows: int) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    client = server.client()
    batch = submit(client, jsonl(line(f"r{i}", chat_body(f"Say {i}", max_tokens=6)) for i in range(rows)))
    http = httpx.Client(base_url=server.base_url, timeout=60)
    seen_api: dict[int, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            b = http.get(f"/v1/batches/{batch.id}").json()
            done = b["request_counts"]["completed"] + b["request_counts"]["failed"]
            seen_api.setdefault(done, time.time() * 1000)
            if b["status"] in STATUSES:
                return
            time.sleep(0.01)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
        page = browser.new_context(bypass_csp=True).new_page()  # the bench's observer script only
        page.goto(f"{server.base_url}/console/?q={batch.id}")
        page.locator("html[data-live=socket]").wait_for(state="attached")
        page.evaluate(WATCH)
        poller = threading.Thread(target=poll)
        poller.start()
        poller.join(timeout=300)
        page.wait_for_timeout(1500)  # the last events reach the page
        changes = page.evaluate("window.__changes")
        browser.close()
    stop.set()
    http.close()
    shown: dict[int, float] = {}
    for text, at in changes:
        done = int(str(text).split("/")[0].strip() or 0)
        shown.setdefault(done, float(at))
    latencies = [shown[k] - seen_api[k] for k in shown if k in seen_api and k > 0]
    return {
        "rows": rows,
        "counts_seen_in_browser": len(shown),
        "counts_seen_by_api_poll": len(seen_api),
        "p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "p95_ms": round(percentile(latencies, 0.95), 1) if latencies else None,
        "max_ms": round(max(latencies), 1) if latencies else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=20)
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-console-"))
    model = build_tiny_model(root / "model")
    url = f"sqlite:///{root / 'miserver.db'}"
    with tiny_server_process(model, root, database_url=url) as server:
        pass  # first start: creates the schema
    asyncio.run(seed(url, args.batches))
    with tiny_server_process(model, root, database_url=url, env={"BATCH_CHUNK_ROWS": "2"}) as server:
        lists = job_list(server.base_url, args.loads)
        for name, numbers in lists.items():
            print(f"{name:24s} p50 {numbers['p50_ms']:7.1f} ms   p95 {numbers['p95_ms']:7.1f} ms")
        ratio = lists["console list"]["p95_ms"] / lists["api list (yardstick)"]["p95_ms"]
        print(f"console list / api list at p95: {ratio:.2f}x  ({args.batches} batches, {args.loads} loads each)")
        latency = progress_latency(server, args.rows)
        print(
            f"progress in the browser after the API saw it: p50 {latency['p50_ms']} ms, p95 {latency['p95_ms']} ms, "
            f"max {latency['max_ms']} ms over {latency['counts_seen_in_browser']} counts"
        )
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    out = {"batches": args.batches, "loads": args.loads, "job_list": lists, "ratio_p95": ratio, "progress": latency}
    (results / "console.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
