"""Scoring, pooled hidden states and packing on the tiny model, float32 (DESIGN §3.4 scoring mode, §4 packing).

Engine level: a one-token scoring request is the step loop's one-token generation, bit for bit; prompt logprobs
equal a plain forward pass; a pack agrees with its rows run alone. Service level: the many-rows call answers every
row as the synchronous ``create`` does (same errors, the same response up to float rounding), and the planners
partition the units.
"""

from __future__ import annotations

import base64
import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from miserver.batches.packing import budget_packs, fixed_packs, sorted_packs
from miserver.engines.adapter import generation_request
from miserver.engines.base import PoolRequest, ScoreRequest
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.score import MIN_SHARED_PREFIX, shared_prefix
from miserver.errors import APIError
from miserver.scheduling.admission import AdmissionGate, Priority
from miserver.services.inference import chat, completions, embeddings
from miserver.services.inference.context import Call, ServiceContext, ServiceResult
from miserver.services.inference.many import Outcome, check_partition

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up.",
    "a",
    "Once upon a time there was",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12",
]
TOL = 1e-4  # float32, packed against alone (measured about 1e-6 on this model)


@pytest.fixture
def ctx(engine: LocalEngine) -> ServiceContext:
    return ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0))


def score_request(engine: LocalEngine, text: str, *, k: int | None = None, **params: Any) -> ScoreRequest:
    defaults: dict[str, Any] = dict(max_tokens=1, temperature=0.0, top_p=None, stop=None, seed=1, logprobs=3, n=1)
    gen = generation_request(engine.tokenize(text), **{**defaults, **params})
    return ScoreRequest(gen, prompt_logprobs=k)


# -- engine ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0, seed=7, n=3), dict(top_p=0.5, seed=2)])
async def test_score_chooses_what_generate_chooses(engine: LocalEngine, params: dict[str, Any]) -> None:
    """A one-token scoring request is the step loop's prefill-only sequence: its answer is the one-token generation's
    bit for bit, and the first token (with its logprobs) of the same request generated further."""
    for text in TEXTS:
        req = score_request(engine, text, **params)
        scored = (await engine.score(req)).generation
        assert scored == await engine.generate(req.generation)
        longer = await engine.generate(replace(req.generation, params=replace(req.generation.params, max_tokens=4)))
        for a, b in zip(scored.sequences, longer.sequences, strict=True):
            assert a.logprobs is not None and b.logprobs is not None
            assert (a.token_ids, a.logprobs) == (b.token_ids[:1], b.logprobs[:1])


async def test_score_handles_eos_like_generate(engine: LocalEngine) -> None:
    req = score_request(engine, TEXTS[1])
    first = (await engine.score(req)).generation.sequences[0].token_ids[0]
    saved = engine.eos_ids
    engine.eos_ids = frozenset({first})
    try:
        seq = (await engine.score(req)).generation.sequences[0]
        gen = (await engine.generate(req.generation)).sequences[0]
    finally:
        engine.eos_ids = saved
    assert (seq.token_ids, seq.text, seq.finish_reason) == ([], "", "stop")
    assert (gen.token_ids, gen.text, gen.finish_reason) == ([], "", "stop")


async def test_prompt_logprobs_equal_a_plain_forward_pass(engine: LocalEngine) -> None:
    ids = engine.tokenize(TEXTS[1])
    req = score_request(engine, TEXTS[1], k=4, max_tokens=0)
    result = await engine.score(req)
    with torch.inference_mode():
        logits = engine.loaded.model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    lps = result.prompt_logprobs
    assert lps is not None and result.prompt_tokens is not None
    assert len(lps) == len(ids) == len(result.prompt_tokens) and lps[0] is None
    assert "".join(result.prompt_tokens) == TEXTS[1]
    for pos in range(1, len(ids)):
        lp = lps[pos]
        assert lp is not None and lp.token_id == ids[pos]
        assert abs(lp.logprob - float(logp[pos - 1, ids[pos]])) < TOL
        assert [t for t, _, _ in lp.top] == torch.topk(logp[pos - 1], 4).indices.tolist()
    assert result.generation.sequences[0].token_ids == [] and result.generation.completion_tokens == 0


async def test_a_pack_agrees_with_its_rows_alone(engine: LocalEngine) -> None:
    """A pack's tokens are its rows' alone bit for bit (the step loop's prefill), their prompt logprobs (one
    right-padded pass) within float32 rounding; the prompt logprobs beside a token are those asked for alone."""
    reqs = [score_request(engine, t, k=2) for t in TEXTS]
    alone = [await engine.score(r) for r in reqs]
    packed = await engine.score_many(reqs)
    worst = 0.0
    for r, a, p in zip(reqs, alone, packed, strict=True):
        assert a.generation == p.generation
        prompt_only = await engine.score(
            replace(r, generation=replace(r.generation, params=replace(r.generation.params, max_tokens=0)))
        )
        assert a.prompt_logprobs == prompt_only.prompt_logprobs and a.prompt_tokens == prompt_only.prompt_tokens
        assert a.prompt_logprobs is not None and p.prompt_logprobs is not None
        for x, y in zip(a.prompt_logprobs[1:], p.prompt_logprobs[1:]):
            assert x is not None and y is not None and x.token_id == y.token_id
            worst = max(worst, abs(x.logprob - y.logprob))
    assert worst < TOL


async def test_score_refuses_generation_and_empty_prompts(engine: LocalEngine) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        await engine.score(score_request(engine, "x", max_tokens=2))
    empty = ScoreRequest(replace(score_request(engine, "x").generation, prompt_ids=()))
    with pytest.raises(ValueError, match="no tokens"):
        await engine.score(empty)
    nothing = ScoreRequest(replace(empty.generation, params=replace(empty.generation.params, max_tokens=0)))
    assert (await engine.score(nothing)).generation.sequences[0].finish_reason == "length"
    too_long = ScoreRequest(replace(empty.generation, prompt_ids=(5,) * (engine.context_length + 1)))
    with pytest.raises(ValueError, match="context"):  # the step loop's refusal ends the pack
        await engine.score_many([score_request(engine, "x"), too_long])


async def test_pooled_vectors_are_the_hidden_states_pooled(engine: LocalEngine) -> None:
    ids = engine.tokenize(TEXTS[3])
    with torch.inference_mode():
        out = engine.loaded.model.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    final = out.last_hidden_state[0].float()
    mean = await engine.embed(PoolRequest(tuple(ids), pooling="mean", normalize=True))
    last = await engine.embed(PoolRequest(tuple(ids), pooling="last", normalize=True))
    assert mean.dtype == np.float32 and mean.shape == (engine.info.hidden_size,)
    expect_mean = final.mean(0) / final.mean(0).norm()
    expect_last = final[-1] / final[-1].norm()
    assert np.allclose(mean, expect_mean.numpy(), atol=1e-6) and np.allclose(last, expect_last.numpy(), atol=1e-6)
    assert abs(float(np.linalg.norm(mean)) - 1.0) < 1e-5
    layer1 = await engine.embed(PoolRequest(tuple(ids), pooling="mean", layer=1))
    assert np.allclose(layer1, out.hidden_states[1][0].float().mean(0).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="layer"):
        await engine.embed(PoolRequest(tuple(ids), layer=engine.info.num_layers + 1))


@pytest.mark.parametrize("pooling", ["mean", "last"])
async def test_packed_embeddings_agree_with_single(engine: LocalEngine, pooling: str) -> None:
    reqs = [PoolRequest(tuple(engine.tokenize(t)), pooling=pooling, normalize=True) for t in TEXTS]  # type: ignore[arg-type]
    alone = [await engine.embed(r) for r in reqs]
    packed = await engine.embed_many(reqs)
    assert min(float(np.dot(a, p)) for a, p in zip(alone, packed)) > 1 - 1e-6


# -- planners --------------------------------------------------------------------------------------------------


def test_planners_partition_and_respect_the_budget() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(1, 300) for _ in range(157)] + [5000]
    for packs in (fixed_packs(lengths, 16), sorted_packs(lengths, 16), budget_packs(lengths, 4096)):
        check_partition(packs, len(lengths))
    assert fixed_packs(lengths, 16)[0] == list(range(16))
    for pack in sorted_packs(lengths, 16)[:-1]:
        assert len(pack) == 16
    budget = budget_packs(lengths, 4096)
    for pack in budget:
        assert len(pack) == 1 or len(pack) * max(lengths[i] for i in pack) <= 4096
    assert [5000] in [[lengths[i] for i in p] for p in budget]
    widths = [max(lengths[i] for i in p) for p in budget]
    assert widths == sorted(widths)  # similar lengths together, short units in wide packs first
    capped = budget_packs(lengths, 4096, max_padding=0.1)
    check_partition(capped, len(lengths))
    for pack in capped:
        size = len(pack) * max(lengths[i] for i in pack)
        assert size <= 4096 or len(pack) == 1
        assert size - sum(lengths[i] for i in pack) <= 0.1 * size
    assert len(capped) > len(budget)
    assert budget_packs([7] * 10, 35, max_padding=0.0) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError):
        check_partition([[0, 1], [1]], 2)


# -- services: the many-rows call against the synchronous create ----------------------------------------------


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 5,
        **extra,
    }


async def many(
    service: Any, ctx: ServiceContext, bodies: list[Any], plan: Any = None, call: Call | None = None
) -> dict[int, Outcome]:
    call = call or Call(strict=True, priority=Priority.BATCH)
    plan = plan or (lambda lengths: budget_packs(lengths, 4096))
    return {o.index: o async for o in service.create_many(ctx, bodies, call, plan)}


async def single(service: Any, ctx: ServiceContext, body: Any) -> ServiceResult | APIError:
    try:
        result = await service.create(ctx, body, Call(strict=True))
    except APIError as exc:
        return exc
    assert isinstance(result, ServiceResult)
    return result


def assert_same_response(a: dict[str, Any], b: dict[str, Any], path: str = "") -> None:
    """Equal bodies except ids, timestamps, and floats within ``TOL``."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            if k not in ("id", "created"):
                assert_same_response(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_response(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert isinstance(b, float) and abs(a - b) < TOL, (path, a, b)
    else:
        assert a == b, (path, a, b)


async def test_chat_many_rows_answer_as_create(ctx: ServiceContext) -> None:
    bodies: list[Any] = [chat_body(t) for t in TEXTS]
    bodies += [chat_body("generate a few", max_tokens=4), chat_body("x " * 600), chat_body("y", bogus=1), "not a dict"]
    outcomes = await many(chat, ctx, bodies)
    assert sorted(outcomes) == list(range(len(bodies)))
    for i, body in enumerate(bodies):
        expected = await single(chat, ctx, body)
        got = outcomes[i]
        if isinstance(expected, APIError):
            assert isinstance(got.result, APIError) and not got.packed
            assert (got.result.status_code, got.result.envelope()) == (expected.status_code, expected.envelope())
        else:
            assert isinstance(got.result, ServiceResult)
            assert got.packed is (i < len(TEXTS))  # scoring rows pack; the generation row runs alone
            assert got.result.headers == expected.headers
            assert_same_response(got.result.body, expected.body)
    assert outcomes[len(TEXTS) + 1].result.code == "context_length_exceeded"  # type: ignore[union-attr]


async def test_completions_echo_scoring_shape_and_many_rows(ctx: ServiceContext, engine: LocalEngine) -> None:
    prompts = ["The cat sat on the mat", "Dogs bark"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 2}
    result = await single(completions, ctx, body)
    assert isinstance(result, ServiceResult)
    first = result.body["choices"][0]
    lp = first["logprobs"]
    ids = engine.tokenize("The cat sat on the mat")
    assert first["text"] == "The cat sat on the mat" and first["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == first["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [len("".join(lp["tokens"][:k])) for k in range(len(ids))]
    assert result.body["usage"]["completion_tokens"] == 0
    scoring_one = {**body, "max_tokens": 1, "seed": 3}
    generating = {**body, "max_tokens": 3, "seed": 3}
    outcomes = await many(completions, ctx, [body, scoring_one, generating])
    for i, b in enumerate([body, scoring_one, generating]):
        got = outcomes[i]
        expected = await single(completions, ctx, b)
        assert isinstance(got.result, ServiceResult) and isinstance(expected, ServiceResult)
        assert got.packed is (i < 2)
        assert_same_response(got.result.body, expected.body)
    gen_lp = outcomes[2].result.body["choices"][0]["logprobs"]  # type: ignore[union-attr]
    assert len(gen_lp["tokens"]) == len(ids) + 3 and gen_lp["token_logprobs"][0] is None


async def test_embeddings_formats_errors_and_many_rows(ctx: ServiceContext, engine: LocalEngine) -> None:
    base = {"model": "tiny", "input": TEXTS[:3]}
    floats = await single(embeddings, ctx, {**base, "encoding_format": "float"})
    b64 = await single(embeddings, ctx, {**base, "encoding_format": "base64"})
    assert isinstance(floats, ServiceResult) and isinstance(b64, ServiceResult)
    for f, e in zip(floats.body["data"], b64.body["data"]):
        decoded = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4").tolist()
        assert decoded == f["embedding"] and len(decoded) == engine.info.hidden_size
    tokens = sum(len(engine.tokenize(t)) for t in TEXTS[:3])
    assert floats.body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    as_ids = await single(embeddings, ctx, {"model": "tiny", "input": [engine.tokenize(t) for t in TEXTS[:3]]})
    assert isinstance(as_ids, ServiceResult) and as_ids.body["data"] == floats.body["data"]
    one_list = await single(embeddings, ctx, {"model": "tiny", "input": engine.tokenize(TEXTS[0])})
    assert isinstance(one_list, ServiceResult) and one_list.body["data"][0] == floats.body["data"][0]
    refusals = {
        "dimensions": ({**base, "dimensions": 8}, "unsupported_parameter"),
        "input": ({"model": "tiny", "input": "word " * 600}, "context_length_exceeded"),
        "input[1]": ({"model": "tiny", "input": ["ok", ""]}, "invalid_value"),
        "pooling": ({**base, "pooling": "max"}, "invalid_value"),
    }
    for param, (body, code) in refusals.items():
        err = await single(embeddings, ctx, body)
        assert isinstance(err, APIError) and (err.status_code, err.param, err.code) == (400, param, code), param
    assert isinstance(await single(embeddings, ctx, {**base, "dimensions": engine.info.hidden_size}), ServiceResult)
    bodies = [{"model": "tiny", "input": TEXTS, "pooling": "last"}, {"model": "tiny", "input": "word " * 600}, base]
    outcomes = await many(embeddings, ctx, bodies)
    for i, body in enumerate(bodies):
        expected = await single(embeddings, ctx, body)
        got = outcomes[i]
        if isinstance(expected, APIError):
            assert isinstance(got.result, APIError) and got.result.envelope() == expected.envelope()
            continue
        assert isinstance(got.result, ServiceResult) and got.packed
        for g, e in zip(got.result.body["data"], expected.body["data"]):
            assert float(np.dot(g["embedding"], e["embedding"])) > 1 - 1e-6


async def test_many_rows_stop_between_packs_and_survive_a_failing_pack(
    ctx: ServiceContext, engine: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    bodies = [chat_body(t) for t in TEXTS]
    one_per_pack = lambda lengths: [[i] for i in range(len(lengths))]  # noqa: E731
    packs_run: list[int] = []
    call = Call(strict=True, priority=Priority.BATCH, should_stop=lambda: len(packs_run) >= 2)
    real = engine.score_many

    async def counting(requests: Any) -> Any:
        packs_run.append(len(requests))
        return await real(requests)

    monkeypatch.setattr(engine, "score_many", counting)
    stopped = await many(chat, ctx, bodies, one_per_pack, call)
    assert len(stopped) == 2 and packs_run == [1, 1]
    assert not any(o.packed for o in stopped.values()), "a pack of one is the row alone: packed false"

    async def broken(requests: Any) -> Any:  # a wide pack runs out of memory; one row alone fits
        if len(requests) > 1:
            raise RuntimeError("out of memory")
        return await real(requests)

    monkeypatch.setattr(engine, "score_many", broken)
    outcomes = await many(chat, ctx, bodies)
    for i, body in enumerate(bodies):
        expected = await single(chat, ctx, body)
        assert isinstance(outcomes[i].result, ServiceResult) and isinstance(expected, ServiceResult)
        assert outcomes[i].packed is False  # retried one at a time
        assert_same_response(outcomes[i].result.body, expected.body)


async def test_a_shared_prefix_runs_once_and_changes_nothing(engine: LocalEngine) -> None:
    system = {"role": "system", "content": "Label the text as positive or negative. Think about the tone of the words."}
    rows = [engine.tokenize_chat([system, {"role": "user", "content": t}]) for t in TEXTS]
    common = shared_prefix(rows)
    assert common >= MIN_SHARED_PREFIX and all(len(r) > common for r in rows)
    widths: list[int] = []
    hook = engine.loaded.model.base_model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(int(kw["input_ids"].shape[1])), with_kwargs=True
    )
    try:
        params = dict(max_tokens=1, temperature=0.0, top_p=None, stop=None, seed=1, logprobs=3, n=1)
        reqs = [ScoreRequest(generation_request(r, **params), prompt_logprobs=1) for r in rows]  # type: ignore[arg-type]
        packed = await engine.score_many(reqs)
        assert widths == [common, max(len(r) for r in rows) - common]  # the prefix once, then the rest of every row
        alone = [await engine.score(r) for r in reqs]
        embeds = [PoolRequest(tuple(r), pooling="mean", normalize=True) for r in rows]
        packed_vectors = await engine.embed_many(embeds)
        alone_vectors = [await engine.embed(e) for e in embeds]
    finally:
        hook.remove()
    for a, p in zip(alone, packed):
        sa, sp = a.generation.sequences[0], p.generation.sequences[0]
        assert sa.token_ids == sp.token_ids and sa.logprobs and sp.logprobs
        assert abs(sa.logprobs[0].logprob - sp.logprobs[0].logprob) < TOL
        assert a.prompt_logprobs and p.prompt_logprobs
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], p.prompt_logprobs[1:])) < TOL  # type: ignore[union-attr]
    assert min(float(np.dot(a, p)) for a, p in zip(alone_vectors, packed_vectors)) > 1 - 1e-6
    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2 and shared_prefix([[1, 2]]) == 0
