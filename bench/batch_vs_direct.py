"""Benchmark: the Batch API path against a direct loop over the same service function, on the real model.

Both paths run the same chat bodies (AG News topic rows, 50 per label by default, the selection of
``tests/e2e/test_real_model.py``) on the embedded SmolLM2-135M-Instruct, one after the other so they never compete
for the CPU:

1. batch: a ``miserver serve`` process on a fresh SQLite database in a temporary directory; upload, create, poll
   every ``--poll-seconds`` (1 s); rows/s from the moment ``batches.create`` returns to the poll that sees
   ``completed`` (``time.monotonic``, client side). The server is stopped before the next phase.
2. direct: in this process, ``LocalEngine.start(model=...)`` and ``miserver.services.inference.chat.create`` with a
   ``ServiceContext(engine, AdmissionGate(1))``, in a loop over the same bodies.

The phases run in ABBA order over ``--rounds`` rounds (batch, direct, direct, batch for 2), so that a drift of the
machine's speed (this machine is shared; two back-to-back direct runs differed by 15%) weighs on both paths alike.
Prints rows/s of every phase, of each path over all rounds and the ratio batch/direct, and writes them with the date
to ``bench/results/batch_vs_direct.json`` (git-ignored). Example::

    .venv/bin/python bench/batch_vs_direct.py --rows 200 --rounds 2
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

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess  # noqa: E402
from miserver.protocol.batches import TERMINAL  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402
from tests.support.agnews import LABELS, balanced_items, few_shot_messages  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "batch_vs_direct.json"
MODEL = EMBEDDED_MODEL_ID
POLL_SECONDS = 1.0  # what a user's polling loop does; the time is measured to within this
MAX_TOKENS = 4


def load_rows(n: int) -> list[dict[str, str]]:
    """The first ``ceil(n / 4)`` rows of each label in file order, cut to ``n`` (file order kept)."""
    return balanced_items(-(-n // len(LABELS)))[:n]


def body_for(row: dict[str, str]) -> dict[str, Any]:
    """The few-shot topic question of ``examples/topics.jsonl`` and the real-model test, greedy."""
    text = f"{row['title']}. {row['description']}"
    return {"model": MODEL, "messages": few_shot_messages(text), "max_tokens": MAX_TOKENS, "temperature": 0}


def answers_of(output: str) -> list[str]:
    lines = [json.loads(x) for x in output.splitlines() if x.strip()]
    return [line["response"]["body"]["choices"][0]["message"]["content"] for line in lines]


def run_batch(bodies: list[dict[str, Any]], model: str, poll_seconds: float = POLL_SECONDS) -> dict[str, Any]:
    """Phase 1: a server process on a fresh SQLite database; the batch timed client side."""
    with tempfile.TemporaryDirectory(prefix="miserver-bench-") as tmp:
        server = ServerProcess(data_dir=Path(tmp) / "var", model=model).start(timeout=600)
        try:
            base = server.base_url
            client = openai.OpenAI(base_url=base + "/v1", api_key="bench", _strict_response_validation=True)
            data = "".join(
                json.dumps({"custom_id": f"ag-{i:03d}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                + "\n"
                for i, b in enumerate(bodies)
            ).encode()
            uploaded = client.files.create(file=("bench.jsonl", data), purpose="batch")
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            t0 = time.monotonic()
            while True:
                b = client.batches.retrieve(batch.id)
                if b.status in TERMINAL:
                    t1 = time.monotonic()
                    break
                time.sleep(poll_seconds)
            if b.status != "completed" or b.request_counts is None or b.request_counts.completed != len(bodies):
                raise RuntimeError(f"batch ended {b.status} with {b.request_counts}: {b.errors}")
            assert b.output_file_id is not None
            answers = answers_of(client.files.content(b.output_file_id).text)
            seconds = t1 - t0
            return {
                "seconds": round(seconds, 3),
                "rows_per_s": round(len(bodies) / seconds, 3),
                "server_seconds": (b.completed_at or 0) - b.created_at,
                "in_progress_seconds": (b.completed_at or 0) - (b.in_progress_at or b.created_at),
                "answers": answers,
            }
        finally:
            server.stop()


async def run_direct(bodies: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Phase 2: the same service function in a loop, in this process (no server running)."""
    from miserver.engines.local.engine import LocalEngine
    from miserver.scheduling.admission import AdmissionGate
    from miserver.services.inference import chat
    from miserver.services.inference.context import Call, ServiceContext, ServiceResult
    from miserver.settings import Settings

    engine = await LocalEngine.start(model=model, cache_dir=Settings().cache_dir)
    try:
        ctx = ServiceContext(engine=engine, gate=AdmissionGate(1))
        answers = []
        t0 = time.monotonic()
        for body in bodies:
            result = await chat.create(ctx, body, Call())
            assert isinstance(result, ServiceResult) and result.status_code == 200
            answers.append(result.body["choices"][0]["message"]["content"])
        seconds = time.monotonic() - t0
    finally:
        await engine.close()
    return {"seconds": round(seconds, 3), "rows_per_s": round(len(bodies) / seconds, 3), "answers": answers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200, help="AG News rows, label-balanced (default: %(default)s)")
    parser.add_argument("--model", default=MODEL, help="model to serve and load (default: %(default)s)")
    parser.add_argument(
        "--poll-seconds", type=float, default=POLL_SECONDS, help="batch status poll interval (default: %(default)s)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds, in ABBA order (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file (default: %(default)s)")
    args = parser.parse_args()

    rows = load_rows(args.rows)
    bodies = [body_for(r) for r in rows]
    if args.model != MODEL:
        for b in bodies:
            b["model"] = args.model
    load_before = os.getloadavg()
    print(f"{len(bodies)} rows, model {args.model}; load average {load_before[0]:.2f}")

    # ABBA order (batch, direct, direct, batch, ...): a drift of the machine's speed during the run (it is shared)
    # weighs on both paths alike instead of on whichever ran later.
    phases: dict[str, list[dict[str, Any]]] = {"batch": [], "direct": []}
    for r in range(args.rounds):
        for path in ("batch", "direct") if r % 2 == 0 else ("direct", "batch"):
            if path == "batch":
                print(f"round {r + 1}, batch path: server process, SQLite, upload + create + poll ...", flush=True)
                run = run_batch(bodies, args.model, args.poll_seconds)
            else:
                print(f"round {r + 1}, direct path: LocalEngine + services.chat.create in a loop ...", flush=True)
                run = asyncio.run(run_direct(bodies, args.model))
            run["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
            print(f"  {path}: {run['rows_per_s']:.2f} rows/s ({run['seconds']:.1f} s)", flush=True)
            phases[path].append(run)
    if max(run["load_average_after"][0] for runs in phases.values() for run in runs) > 1.5 * (os.cpu_count() or 1):
        print("  note: the machine was busy with other work (load average above); the ratio is unreliable")

    answers = [run.pop("answers") for runs in phases.values() for run in runs]
    same = sum(len(set(column)) == 1 for column in zip(*answers, strict=True))
    totals = {path: sum(run["seconds"] for run in runs) for path, runs in phases.items()}
    rows = len(bodies) * args.rounds
    batch = {
        "seconds": round(totals["batch"], 3),
        "rows_per_s": round(rows / totals["batch"], 3),
        "runs": phases["batch"],
    }
    direct = {
        "seconds": round(totals["direct"], 3),
        "rows_per_s": round(rows / totals["direct"], 3),
        "runs": phases["direct"],
    }
    ratio = totals["direct"] / totals["batch"]
    print(f"all rounds: batch {batch['rows_per_s']:.3f} rows/s, direct {direct['rows_per_s']:.3f} rows/s")
    print(f"  ratio batch/direct: {ratio:.3f}; identical answers in every run: {same}/{len(bodies)}")

    import torch

    result = {
        "benchmark": "batch_vs_direct",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "rows": len(bodies),
        "max_tokens": MAX_TOKENS,
        "poll_seconds": args.poll_seconds,
        "rounds": args.rounds,
        "batch": batch,
        "direct": direct,
        "ratio_batch_over_direct": round(ratio, 4),
        "identical_answers": same,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": [round(x, 2) for x in load_before],
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
