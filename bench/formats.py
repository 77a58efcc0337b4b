"""Benchmark (issue 11, "Measured"): the translation overhead of the request formats, through the Batch API.

The same rows (AG News topic questions, the few-shot conversation of ``bench/batch_vs_direct.py``, greedy, at most
``--max-tokens`` output tokens: 16, the Responses API's floor for ``max_output_tokens``) are written once per format
and run as batches on ONE server, one batch at a time, the formats in ABBA order over ``--rounds`` rounds (chat,
responses, responses, chat for 2) so that a drift of the shared machine's speed weighs on every format alike:

- ``chat``: ``/v1/chat/completions`` lines (``messages``, ``max_tokens``);
- ``responses``: ``/v1/responses`` lines (the same turns as ``input``, ``max_output_tokens``; ``store`` as OpenAI's
  default, true, unless ``--no-store``).

A batch is timed client side, from the moment ``batches.create`` returns to the poll (every ``--poll-seconds``) that
sees it terminal; an untimed batch of ``--warmup-rows`` rows per format runs first. Prints rows/s per format and each
format's ratio to chat (the issue's goal: within 5%), checks that every format returned the same answers, and writes
``bench/results/formats.json`` (git-ignored).

Another format plugs in as one more :data:`FORMATS` entry: its batch endpoint, how a row's turns become its body, and
where its output body keeps the answer's text.

Examples::

    .venv/bin/python bench/formats.py                       # the embedded SmolLM2-135M, 200 rows, 2 rounds
    .venv/bin/python bench/formats.py --tiny --rows 200      # the tests' tiny random model (seconds, not minutes)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miserver.process import ServerProcess  # noqa: E402
from miserver.protocol.batches import TERMINAL  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402
from tests.support.agnews import LABELS, balanced_items, few_shot_messages  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "formats.json"
MAX_TOKENS = 16
POLL_SECONDS = 0.2

Turns = list[dict[str, str]]


@dataclass(frozen=True)
class Format:
    """A batch line format: its ``endpoint``, ``body(model, turns, max_tokens, store)`` making a row's body from
    the conversation, and ``text(body)`` reading the answer from an output line's ``response.body``."""

    endpoint: str
    body: Callable[[str, Turns, int, bool], dict[str, Any]]
    text: Callable[[dict[str, Any]], str]


def _chat_body(model: str, turns: Turns, max_tokens: int, store: bool) -> dict[str, Any]:
    del store  # a chat completion is never stored
    return {"model": model, "messages": turns, "max_tokens": max_tokens, "temperature": 0}


def _responses_body(model: str, turns: Turns, max_tokens: int, store: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "input": turns, "max_output_tokens": max_tokens, "temperature": 0}
    if not store:
        body["store"] = False
    return body


def _responses_text(body: dict[str, Any]) -> str:
    return "".join(part["text"] for item in body["output"] for part in item["content"])


def _messages_body(model: str, turns: Turns, max_tokens: int, store: bool) -> dict[str, Any]:
    del store  # an Anthropic Message is never stored
    system = "\n".join(t["content"] for t in turns if t["role"] == "system")
    body: dict[str, Any] = {
        "model": model,
        "messages": [t for t in turns if t["role"] != "system"],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if system:
        body["system"] = system
    return body


def _messages_text(body: dict[str, Any]) -> str:
    return "".join(block["text"] for block in body["content"] if block["type"] == "text")


#: The formats measured, chat (the reference) first.
FORMATS: dict[str, Format] = {
    "chat": Format("/v1/chat/completions", _chat_body, lambda b: b["choices"][0]["message"]["content"] or ""),
    "responses": Format("/v1/responses", _responses_body, _responses_text),
    "messages": Format("/anthropic/v1/messages", _messages_body, _messages_text),
}


def load_turns(n: int) -> list[Turns]:
    """The first ``ceil(n / 4)`` AG News rows of each label, cut to ``n``, as few-shot topic conversations."""
    rows = balanced_items(-(-n // len(LABELS)))[:n]
    return [few_shot_messages(f"{r['title']}. {r['description']}") for r in rows]


def run_batch(client: openai.OpenAI, fmt: Format, bodies: list[dict[str, Any]], poll_seconds: float) -> dict[str, Any]:
    """Upload, create, poll until terminal; rows/s from the create to the poll that sees the batch end."""
    data = "".join(
        json.dumps({"custom_id": f"row-{i:04d}", "method": "POST", "url": fmt.endpoint, "body": b}) + "\n"
        for i, b in enumerate(bodies)
    ).encode()
    uploaded = client.files.create(file=("formats.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=fmt.endpoint, completion_window="24h")  # type: ignore[arg-type]
    t0 = time.monotonic()
    while True:
        b = client.batches.retrieve(batch.id)
        if b.status in TERMINAL:
            seconds = time.monotonic() - t0
            break
        time.sleep(poll_seconds)
    if b.status != "completed" or b.request_counts is None or b.request_counts.completed != len(bodies):
        raise RuntimeError(f"{fmt.endpoint}: batch ended {b.status} with {b.request_counts}: {b.errors}")
    assert b.output_file_id is not None
    lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines() if x.strip()]
    lines.sort(key=lambda x: x["custom_id"])
    return {
        "seconds": round(seconds, 3),
        "rows_per_s": round(len(bodies) / seconds, 3),
        "usage": b.usage.model_dump() if b.usage else None,
        "answers": [fmt.text(x["response"]["body"]) for x in lines],
    }


def serve(args: argparse.Namespace, tmp: Path) -> tuple[ServerProcess, str]:
    """The server (and the model id rows name): the embedded model, ``--model``, or the tiny random model."""
    if args.tiny:
        from tests.support.tiny_model import build_tiny_model

        model_dir = build_tiny_model(tmp / "tiny-model")
        server = ServerProcess(model=str(model_dir), served_model_name="tiny", data_dir=tmp / "var")
        return server, "tiny"
    return ServerProcess(model=args.model, data_dir=tmp / "var"), args.model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200, help="rows per batch (default: %(default)s)")
    parser.add_argument("--model", default=EMBEDDED_MODEL_ID, help="model to serve (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="serve the tests' tiny random model instead")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="output tokens (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, in ABBA order (default: %(default)s)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="formats to run (default: %(default)s)")
    parser.add_argument(
        "--warmup-rows", type=int, default=8, help="untimed rows per format first (default: %(default)s)"
    )
    parser.add_argument("--no-store", action="store_true", help="Responses rows with store: false")
    parser.add_argument("--poll-seconds", type=float, default=POLL_SECONDS, help="(default: %(default)s)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file (default: %(default)s)")
    args = parser.parse_args()
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names or names[0] != "chat":
        parser.error(f"--formats: chat first, then any of {', '.join(FORMATS)} (unknown: {unknown})")

    turns = load_turns(args.rows)
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="miserver-formats-") as tmp:
        server, model = serve(args, Path(tmp))
        with server.start(timeout=600):
            client = server.client()
            bodies = {n: [FORMATS[n].body(model, t, args.max_tokens, not args.no_store) for t in turns] for n in names}
            print(f"{len(turns)} rows, model {model}, formats {names}; load average {load_before[0]:.2f}", flush=True)
            for name in names:  # untimed: the first batch of a fresh server pays for warming up (caches, threads)
                run_batch(client, FORMATS[name], bodies[name][: args.warmup_rows], args.poll_seconds)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else list(reversed(names)):
                    run = run_batch(client, FORMATS[name], bodies[name], args.poll_seconds)
                    run["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
                    print(
                        f"  round {r + 1} {name}: {run['rows_per_s']:.2f} rows/s ({run['seconds']:.1f} s)", flush=True
                    )
                    runs[name].append(run)

    reference = runs["chat"][0]["answers"]
    same = {n: all(run.pop("answers") == reference for run in rs) for n, rs in runs.items()}
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        seconds = sum(run["seconds"] for run in rs)
        summary[name] = {
            "seconds": round(seconds, 3),
            "rows_per_s": round(len(turns) * len(rs) / seconds, 3),
            "runs": rs,
        }
    chat_rate = summary["chat"]["rows_per_s"]
    for name in names:
        ratio = summary[name]["rows_per_s"] / chat_rate
        summary[name]["ratio_to_chat"] = round(ratio, 4)
        print(
            f"{name}: {summary[name]['rows_per_s']:.3f} rows/s, ratio to chat {ratio:.3f}, same answers: {same[name]}"
        )
    busy = max(run["load_average_after"][0] for rs in runs.values() for run in rs) > 1.5 * (os.cpu_count() or 1)
    if busy:
        print("  note: the machine was busy with other work (load average above); the ratios are less reliable")

    import torch

    result = {
        "benchmark": "formats",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model": model,
        "tiny_model": args.tiny,
        "rows": len(turns),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "warmup_rows": args.warmup_rows,
        "responses_store": not args.no_store,
        "poll_seconds": args.poll_seconds,
        "formats": summary,
        "same_answers_as_chat": same,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_at_start": [round(x, 2) for x in load_before],
            "busy": busy,
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
