"""Resume after crashes (issue 4's measurement): a 200-row AG News batch on the real SmolLM2, the server killed
with SIGKILL three times at random points and restarted on the same database.

Prints rows executed / rows in the file (from the engine's execution log), how many re-runs were rows in flight at
a kill, and the ratio for recorded rows (goal 1.00: a row with a recorded result never runs again).
Writes ``bench/results/resume.json``.

Usage: ``.venv/bin/python bench/resume.py [--rows 200] [--kills 3] [--database-url URL]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess, wait_for  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402
from tests.support.agnews import agnews_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--database-url", default=None, help="default: SQLite in a temp dir")
    args = parser.parse_args()
    rng = random.Random(11)
    points = sorted(rng.sample(range(10, args.rows - 10), args.kills))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "executions.log"
        url = args.database_url or f"sqlite:///{tmp}/bench.db"

        def start() -> ServerProcess:
            return ServerProcess(
                model=EMBEDDED_MODEL_ID,
                database_url=url,
                data_dir=Path(tmp) / "var",
                env={"MISERVER_EXECUTION_LOG": str(log), "BATCH_POLL_SECONDS": "0.2"},
            ).start()

        server = start()
        client = server.client()
        lines = "".join(
            json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
            for cid, body, _ in agnews_rows(args.rows)
        ).encode()
        batch = client.batches.create(
            input_file_id=client.files.create(file=("agnews.jsonl", lines), purpose="batch").id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        t0 = time.perf_counter()
        in_flight = []
        restart_s = []
        try:
            for point in points:

                def reached(server: ServerProcess = server, point: int = point) -> bool:
                    counts = server.client().batches.retrieve(batch.id).request_counts
                    return counts is not None and counts.completed >= point

                wait_for(reached, timeout=1800, interval=0.2)
                server.kill9()
                in_flight.append(log.read_text().split()[-1])
                r0 = time.perf_counter()
                server = start()
                restart_s.append(time.perf_counter() - r0)
            client = server.client()
            done = wait_for(
                lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=1800, interval=0.2
            )
            out = client.files.content(done.output_file_id).text.splitlines()
        finally:
            server.stop()
        wall = time.perf_counter() - t0
        counts = Counter(log.read_text().split())
    ids = [json.loads(x)["custom_id"] for x in out]
    reruns = {d for d, n in counts.items() if n > 1}
    recorded_reruns = reruns - set(in_flight)
    executions = sum(counts.values())
    result = {
        "date": datetime.date.today().isoformat(),
        "database": url.split(":", 1)[0].split("+", 1)[0],
        "rows": args.rows,
        "kills": args.kills,
        "kill_points": points,
        "executions": executions,
        "executions_per_row": executions / args.rows,
        "reruns_in_flight": len(reruns & set(in_flight)),
        "reruns_of_recorded_rows": len(recorded_reruns),
        "recorded_rows_ratio": (executions - len(reruns & set(in_flight))) / args.rows,
        "each_custom_id_once": len(ids) == len(set(ids)) == args.rows,
        "restart_s": restart_s,
        "wall_s": wall,
    }
    restarts = ", ".join(f"{s:.1f}" for s in restart_s)
    print(f"{args.rows} rows, {args.kills} kills at {points}; restarts took {restarts} s")
    print(f"rows executed / rows in the file: {result['executions_per_row']:.3f} ({executions}/{args.rows})")
    print(
        f"re-runs of rows in flight at a kill: {result['reruns_in_flight']}; of recorded rows: {len(recorded_reruns)}"
    )
    print(
        f"recorded rows ratio (goal 1.00): {result['recorded_rows_ratio']:.2f}; "
        f"each custom_id once: {result['each_custom_id_once']}"
    )
    out_path = ROOT / "bench" / "results" / "resume.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"written to {out_path}")


if __name__ == "__main__":
    main()
