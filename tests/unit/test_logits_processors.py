"""Per-sequence logits processors of the local engine (``engines/local/processors.py``) on the tiny random Llama.

``logit_bias`` moves the greedy choice; OpenAI's penalty formula is applied exactly; a grammar holds the text to its
JSON schema (a complete object ends ``"stop"``, one cut by ``max_tokens`` ends ``"length"``); each sequence in a
shared step keeps its own processors; a grammar compiles once for many requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miserver.engines.base import GenerationRequest, GenerationResult, Grammar, SamplingParams
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.loader import load_model, resolve_model_source
from miserver.engines.local.processors import Processors, process

PROMPT = "tell me about the sea"
FLAG = Grammar(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
            "required": ["ok", "size"],
            "additionalProperties": False,
        }
    ),
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    loaded = load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path_factory.mktemp("cache"), "cpu")
    eng = LocalEngine.from_loaded(loaded, "tiny")
    yield eng
    asyncio.run(eng.close())


def request(engine: LocalEngine, **params: object) -> GenerationRequest:
    return GenerationRequest(tuple(engine.tokenize(PROMPT)), SamplingParams(**params))  # type: ignore[arg-type]


def run(engine: LocalEngine, *requests: GenerationRequest) -> list[GenerationResult]:
    async def go() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

    return asyncio.run(go())


def test_penalties_follow_openais_formula() -> None:
    logits = torch.zeros(8)
    proc = Processors(SamplingParams(4, frequency_penalty=0.5, presence_penalty=0.25), counts={1: 1, 3: 4})
    out = process(logits, proc)
    expected = torch.zeros(8)
    expected[1] = -(1 * 0.5 + 0.25)
    expected[3] = -(4 * 0.5 + 0.25)
    assert torch.equal(out, expected)
    assert torch.equal(logits, torch.zeros(8)), "the raw logits (reported as logprobs) are left as they were"


def test_logit_bias_moves_the_greedy_choice(engine: LocalEngine) -> None:
    (plain,) = run(engine, request(engine, max_tokens=6, temperature=0.0))
    first = plain.sequences[0].token_ids[0]
    (banned,) = run(engine, request(engine, max_tokens=6, temperature=0.0, logit_bias=((first, -100.0),)))
    assert banned.sequences[0].token_ids[0] != first
    assert first not in banned.sequences[0].token_ids, "-100 bans the token at every position"
    forced = 1234
    (pushed,) = run(engine, request(engine, max_tokens=3, temperature=1.0, seed=5, logit_bias=((forced, 100.0),)))
    assert pushed.sequences[0].token_ids == [forced] * 3


def test_frequency_penalty_changes_a_repetitive_greedy_run(engine: LocalEngine) -> None:
    (plain,) = run(engine, request(engine, max_tokens=24, temperature=0.0))
    (penalised,) = run(engine, request(engine, max_tokens=24, temperature=0.0, frequency_penalty=2.0))
    ids = plain.sequences[0].token_ids
    assert len(set(ids)) < len(ids), "the control run must repeat a token for the test to mean anything"
    fewer = penalised.sequences[0].token_ids
    assert max(fewer.count(t) for t in fewer) < max(ids.count(t) for t in ids)


def test_a_grammar_holds_the_text_to_its_schema(engine: LocalEngine) -> None:
    results = run(engine, *(request(engine, max_tokens=40, temperature=1.0, seed=s, grammar=FLAG) for s in range(3)))
    for result in results:
        seq = result.sequences[0]
        assert seq.finish_reason == "stop", seq.text
        value = json.loads(seq.text)
        assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("small", "large")


def test_a_grammar_cut_by_max_tokens_ends_length(engine: LocalEngine) -> None:
    (result,) = run(engine, request(engine, max_tokens=3, temperature=0.0, grammar=FLAG))
    seq = result.sequences[0]
    assert seq.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(seq.text)


def test_sequences_in_one_step_keep_their_own_processors(engine: LocalEngine) -> None:
    """A constrained, a biased and a plain request share decode steps; each gets what it would get alone."""
    reqs = [
        request(engine, max_tokens=30, temperature=0.0, grammar=FLAG),
        request(engine, max_tokens=8, temperature=0.0, logit_bias=((1234, 100.0),)),
        request(engine, max_tokens=8, temperature=0.0),
    ]
    alone = [run(engine, r)[0] for r in reqs]
    steps = engine.scheduler.steps
    together = run(engine, *reqs)
    shared_steps = engine.scheduler.steps - steps
    assert shared_steps < sum(len(r.sequences[0].token_ids) + 1 for r in alone), "the three must share steps"
    for a, b in zip(alone, together, strict=True):
        assert (b.sequences[0].token_ids, b.sequences[0].finish_reason) == (
            a.sequences[0].token_ids,
            a.sequences[0].finish_reason,
        )


def test_a_grammar_compiles_once_for_many_requests(engine: LocalEngine) -> None:
    schema = Grammar("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    before = engine.grammar_stats.misses, engine.grammar_stats.hits
    run(engine, *(request(engine, max_tokens=4, temperature=0.0, grammar=schema) for _ in range(5)))
    engine.check_grammar(schema)
    assert engine.grammar_stats.misses - before[0] == 1
    assert engine.grammar_stats.hits - before[1] == 5


def test_a_schema_that_cannot_compile_is_refused_with_the_reason(engine: LocalEngine) -> None:
    with pytest.raises(ValueError, match="objekt"):
        engine.check_grammar(Grammar("json_schema", '{"type": "objekt"}'))
