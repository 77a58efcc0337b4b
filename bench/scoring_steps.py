"""One-token scoring requests: a prefill-only sequence of the step loop against a float32 scoring pass, in one run.

Rows: the demo's topic rows (``examples/topics.jsonl``: few-shot chats on the embedded SmolLM2, gold labels in
``topics.gold.jsonl``) at ``max_tokens`` 1, ``temperature`` 0, 5 top logprobs: the first token names the topic. On
one :class:`LocalEngine` (its OpenMP team waiting as the server's does), two ways of answering the same requests,
each timed on the engine:

- ``steps``: ``LocalEngine.score`` / ``score_many``, what every scoring request runs: the token is a prefill-only
  sequence of the step loop over its slot forward (quantized products where the model has them), prompts reused
  from the slots' cache;
- ``pass``: ``score.score_pack`` on the engine thread, the float32 scoring pass through transformers' forward that
  scoring requests ran before (a right-padded pack with its shared prefix run once).

Alone: each row one interactive request (a synchronous one), the two ways alternated row by row (ABAB, the first way
swapped every row). Packed: packs of ``--pack`` rows in file order at batch priority (a ``pack: true`` batch's rows:
the step loop admits them within ``BATCH_PREFILL_TOKENS`` a step), the two ways alternated pack by pack. Printed:
rows/s of each way and the ratio steps/pass, the rows whose top token the two ways choose differently, the largest
difference of the chosen token's logprob where both chose one token, and each way's accuracy against the gold
labels (the label the token begins); then how many rows the step loop answered packed exactly as alone; the load
average at the start and the end. Results:
``bench/results/scoring_steps.json``.

    .venv/bin/python bench/scoring_steps.py
    .venv/bin/python bench/scoring_steps.py --pack 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.runtime import GOMP_SPINCOUNT  # noqa: E402

if "OMP_WAIT_POLICY" not in os.environ:  # OpenMP's waiting as the server sets it, before torch starts OpenMP
    os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))

from miserver.engines.adapter import generation_request  # noqa: E402
from miserver.engines.base import GeneratedSequence, ScoreRequest, ScoreResult  # noqa: E402
from miserver.engines.local.engine import LocalEngine  # noqa: E402
from miserver.engines.local.score import score_pack  # noqa: E402
from miserver.scheduling.admission import Priority  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID, Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "scoring_steps.json"
INPUT, GOLD = ROOT / "examples" / "topics.jsonl", ROOT / "examples" / "topics.gold.jsonl"
LABELS = ("World", "Sports", "Business", "Sci/Tech")


def label_of(token: str) -> str | None:
    """The label a first token begins (``Sci`` begins ``Sci/Tech``), or None."""
    word = token.strip().lower()
    return next((label for label in LABELS if word and label.lower().startswith(word)), None)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


Way = Callable[[Sequence[ScoreRequest]], Awaitable[list[ScoreResult]]]


def load() -> float:
    return round(os.getloadavg()[0], 2)


async def timed(way: Way, requests: Sequence[ScoreRequest]) -> tuple[float, list[ScoreResult]]:
    start = time.perf_counter()
    results = await way(requests)
    return time.perf_counter() - start, results


async def compare(ways: dict[str, Way], units: list[list[ScoreRequest]]) -> dict[str, Any]:
    """Each unit through both ways, the first way swapped unit by unit; seconds and results per way."""
    seconds = {name: 0.0 for name in ways}
    results: dict[str, list[ScoreResult]] = {name: [] for name in ways}
    names = list(ways)
    for k, unit in enumerate(units):
        for name in names if k % 2 == 0 else names[::-1]:
            took, out = await timed(ways[name], unit)
            seconds[name] += took
            results[name] += out
    return {"seconds": seconds, "results": results}


def summary(run: dict[str, Any], golds: list[str], rows: int) -> dict[str, Any]:
    steps, passes = run["results"]["steps"], run["results"]["pass"]
    changed = sum(
        a.generation.sequences[0].token_ids != b.generation.sequences[0].token_ids for a, b in zip(steps, passes)
    )
    worst = 0.0
    for a, b in zip(steps, passes):
        la, lb = a.generation.sequences[0].logprobs, b.generation.sequences[0].logprobs
        if la and lb and la[0].token_id == lb[0].token_id:
            worst = max(worst, abs(la[0].logprob - lb[0].logprob))
    accuracy = {
        name: sum(label_of(r.generation.sequences[0].text) == g for r, g in zip(rs, golds)) / len(golds)
        for name, rs in run["results"].items()
    }
    rate = {name: rows / s for name, s in run["seconds"].items()}
    return {
        "rows_per_s": rate,
        "ratio_steps_over_pass": rate["steps"] / rate["pass"],
        "top_token_changed": changed,
        "max_logprob_diff": worst,
        "accuracy": accuracy,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pack", type=int, default=16, help="rows a pack")
    args = parser.parse_args()
    engine = await LocalEngine.start(EMBEDDED_MODEL_ID, cache_dir=Settings().cache_dir, device="cpu")
    loaded = engine.loaded
    lines = read_jsonl(INPUT)
    gold = {g["custom_id"]: g["label"] for g in read_jsonl(GOLD)}
    golds = [gold[line["custom_id"]] for line in lines]
    params: dict[str, Any] = dict(max_tokens=1, temperature=0.0, top_p=None, stop=None, seed=0, logprobs=5, n=1)
    requests = [
        ScoreRequest(generation_request(engine.tokenize_chat(line["body"]["messages"]), **params)) for line in lines
    ]

    async def by_pass(units: Sequence[ScoreRequest]) -> list[ScoreResult]:
        limit = engine.context_length or None
        return await engine._inference(  # the engine thread, as the scoring pass ran there
            lambda: score_pack(
                loaded.model, loaded.tokenizer, units, pad_id=engine.pad_id, eos_ids=engine.eos_ids, max_positions=limit
            )
        )

    ways: dict[str, Way] = {"steps": engine.score_many, "pass": by_pass}
    await compare(ways, [requests[:2]])  # warm-up: both ways once
    start_load = load()
    print(f"{len(requests)} rows, packs of {args.pack}, load average {start_load}", flush=True)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "rows": len(requests), "load_start": start_load}
    rows = [
        replace(r, generation=replace(r.generation, priority=Priority.BATCH, fairness_key="bench")) for r in requests
    ]
    answers: dict[str, list[list[GeneratedSequence]]] = {}
    for name, units in (
        ("alone", [[r] for r in requests]),
        ("packed", [rows[i : i + args.pack] for i in range(0, len(rows), args.pack)]),
    ):
        run = await compare(ways, units)
        answers[name] = [r.generation.sequences for r in run["results"]["steps"]]
        entry = summary(run, golds, len(requests))
        report[name] = entry
        rate, acc = entry["rows_per_s"], entry["accuracy"]
        print(
            f"{name:<7} steps {rate['steps']:6.2f} rows/s  pass {rate['pass']:6.2f} rows/s  steps/pass "
            f"{entry['ratio_steps_over_pass']:5.2f}x  top token changed {entry['top_token_changed']}/{len(requests)}  "
            f"max |dlogprob| {entry['max_logprob_diff']:.3f}  accuracy steps {acc['steps']:.1%} "
            f"pass {acc['pass']:.1%}  load {load()}",
            flush=True,
        )
    same = sum(a == b for a, b in zip(answers["alone"], answers["packed"], strict=True))
    report["steps_packed_equal_alone"] = same
    print(f"steps: packed rows equal to the same rows alone (tokens, text, logprobs): {same}/{len(requests)}")
    report["load_end"] = load()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"written {RESULTS}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
