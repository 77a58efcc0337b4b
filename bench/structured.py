"""Constrained against unconstrained generation on the resident engine: tokens/s, one at a time and packed.

Rows: ``--rows`` extraction prompts ("Extract the person as JSON: ... is 31 years old and lives in Rome."), greedy,
on the real embedded SmolLM2. Each row runs with the ``json_schema`` grammar of a three-field person object (what
``response_format`` asks for; ``max_tokens`` 40, a warm-up run gives each row's answer length) and without it (plain
text, ``max_tokens`` that length: both sides generate the same tokens per row). "One at a time": the rows are sent
to the engine one after another; "packed": all at once as batch-class sequences (they share decode steps). Sides
alternate ABAB over ``--rounds`` rounds in one run; the ratio is constrained tokens/s over unconstrained tokens/s
(goal: >= 0.8). Also printed: the time to compile the schema the first time (cache cleared), and the grammar
cache's hits and misses over the run (each row asks once).

    python bench/structured.py                      # 16 rows, 2 rounds
    python bench/structured.py --rows 32 --rounds 3

Results are printed and written to ``bench/results/structured.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from miserver.engines.base import GenerationRequest, GenerationResult, Grammar, SamplingParams  # noqa: E402
from miserver.engines.local.engine import LocalEngine  # noqa: E402
from miserver.engines.local.processors import Grammars  # noqa: E402
from miserver.scheduling.admission import Priority  # noqa: E402
from miserver.settings import EMBEDDED_MODEL_ID  # noqa: E402

RESULTS = ROOT / "bench" / "results"
NAMES = ["John Smith", "Mary Jones", "Ali Khan", "Li Wei", "Ana Silva", "Tom Brown", "Eva Novak", "Raj Patel"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Berlin", "Quito", "Dublin", "Seoul"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA, separators=(",", ":")))


def requests(engine: LocalEngine, lengths: list[int], constrained: bool, priority: Priority) -> list[GenerationRequest]:
    """One request per row; row ``i`` may generate ``lengths[i]`` tokens (the constrained answer's own length, so
    that both sides generate the same tokens per row)."""
    out = []
    for i, length in enumerate(lengths):
        text = f"Extract the person as JSON: {NAMES[i % 8]} is {20 + i % 50} years old and lives in {CITIES[i % 10]}."
        prompt = engine.tokenize_chat([{"role": "user", "content": text}])
        params = SamplingParams(length, 0.0, grammar=GRAMMAR if constrained else None)
        out.append(GenerationRequest(tuple(prompt), params, priority=priority, fairness_key="bench"))
    return out


async def timed(engine: LocalEngine, reqs: list[GenerationRequest], packed: bool) -> tuple[float, int, int]:
    """(seconds, generated tokens, rows that finished "stop")."""
    start = time.perf_counter()
    if packed:
        results: list[GenerationResult] = list(await asyncio.gather(*(engine.generate(r) for r in reqs)))
    else:
        results = [await engine.generate(r) for r in reqs]
    seconds = time.perf_counter() - start
    tokens = sum(r.completion_tokens for r in results)
    stopped = sum(1 for r in results if r.sequences[0].finish_reason == "stop")
    return seconds, tokens, stopped


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine = await LocalEngine.start(EMBEDDED_MODEL_ID)
    load_before = os.getloadavg()
    fresh = Grammars(engine.loaded.tokenizer, engine.vocab_size, engine.eos_ids)
    start = time.perf_counter()
    fresh.compile(GRAMMAR)  # includes reading the tokenizer's vocabulary once
    first_compile = time.perf_counter() - start
    start = time.perf_counter()
    fresh.compile(Grammar("json_schema", json.dumps({**SCHEMA, "title": "other"})))
    second_compile = time.perf_counter() - start
    stats_before = (engine.grammar_stats.hits, engine.grammar_stats.misses)
    warm = [await engine.generate(r) for r in requests(engine, [40] * args.rows, True, Priority.INTERACTIVE)]
    lengths = [r.completion_tokens for r in warm]
    report: dict[str, Any] = {"rows": args.rows, "rounds": args.rounds}
    for mode, packed in (("one_at_a_time", False), ("packed", True)):
        totals = {True: [0.0, 0, 0], False: [0.0, 0, 0]}
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)  # ABAB
            for constrained in order:
                priority = Priority.BATCH if packed else Priority.INTERACTIVE
                seconds, tokens, stopped = await timed(engine, requests(engine, lengths, constrained, priority), packed)
                side = totals[constrained]
                side[0] += seconds
                side[1] += int(tokens)
                side[2] += int(stopped)
        rate = {c: totals[c][1] / totals[c][0] for c in (True, False)}
        report[mode] = {
            "constrained_tok_s": round(rate[True], 2),
            "unconstrained_tok_s": round(rate[False], 2),
            "ratio": round(rate[True] / rate[False], 3),
            "constrained_rows_stop": totals[True][2],
            "unconstrained_rows_stop": totals[False][2],
        }
        print(
            f"{mode:14s} constrained {rate[True]:6.2f} tok/s  unconstrained {rate[False]:6.2f} tok/s  "
            f"ratio {rate[True] / rate[False]:.3f}  (rows ending stop: {totals[True][2]} / {totals[False][2]})"
        )
    hits = engine.grammar_stats.hits - stats_before[0]
    misses = engine.grammar_stats.misses - stats_before[1]
    report.update(
        first_compile_ms=round(first_compile * 1000, 1),
        next_compile_ms=round(second_compile * 1000, 2),
        cache_hits=hits,
        cache_misses=misses,
        load_before=[round(x, 2) for x in load_before],
        load_after=[round(x, 2) for x in os.getloadavg()],
        machine=platform.processor() or platform.machine(),
    )
    print(
        f"schema compile: first {first_compile * 1000:.1f} ms (with the vocabulary), next {second_compile * 1000:.2f}"
        f" ms; grammar cache over the run: {hits} hits, {misses} misses; load {load_before} -> {os.getloadavg()}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps(report, indent=2) + "\n")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
