"""Token texts, logprobs and token accounting on the tiny model (issue 10 items 2, 3 and 6, issue 9 item 7).

- a stop string that begins inside a token: ``completion_tokens`` counts every generated token (up to and including
  the one that completed the stop string), the cut token stays in the logprobs, cut to the returned text;
- tokens that hold part of a multi-byte character: each token's own vocabulary bytes (never U+FFFD's), joined
  they rebuild the text; ``token`` is OpenAI's ``bytes:\\xNN`` form where the bytes are not valid UTF-8; the
  completions ``top_logprobs`` dicts keep one key per token; ``tokens`` join to ``text``;
- ``usage`` carries OpenAI's detail objects;
- incremental detokenisation goes through ``tokenizers.decoders.DecodeStream`` (no full decode per token).

The scripted tests steer the logits with forward hooks on transformers' model, so this module's engine decodes
through transformers' forward (``MISERVER_DECODE=transformers``); the text and accounting rules tested here sit
after the forward and are the same for either decode path.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from miserver.batches.packing import budget_packs
from miserver.engines.base import GenerationRequest, SamplingParams, TokenLogprob
from miserver.engines.local.decoding import DecodeOptions
from miserver.engines.local.detokenize import TextStream, _Output, text_pieces, token_texts
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.generate import logprobs_of
from miserver.scheduling.admission import AdmissionGate, Priority
from miserver.services.inference import chat, completions
from miserver.services.inference.context import Call, ServiceContext, ServiceResult, StreamResult
from miserver.settings import EMBEDDED_MODEL_ID
from tests.support.tiny_model import default_cache_dir


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[LocalEngine]:
    """The tiny model decoding through transformers' forward (hooks on it see every step)."""
    decode = DecodeOptions(path="transformers")
    eng = asyncio.run(
        LocalEngine.start(model=str(tiny_model_dir), served_model_name="tiny", device="cpu", decode=decode)
    )
    yield eng
    asyncio.run(eng.close())


JAPANESE = "ありがとう、日本語 😀 héllo"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture
def ctx(engine: LocalEngine) -> ServiceContext:
    return ServiceContext(engine=engine, gate=AdmissionGate(1), rng=random.Random(0))


async def run(service: Any, ctx: ServiceContext, body: dict[str, Any]) -> ServiceResult:
    result = await service.create(ctx, body, Call(strict=True))
    assert isinstance(result, ServiceResult)
    return result


async def run_stream(service: Any, ctx: ServiceContext, body: dict[str, Any]) -> list[dict[str, Any]]:
    result = await service.create(ctx, {**body, "stream": True, "stream_options": {"include_usage": True}}, Call())
    assert isinstance(result, StreamResult)
    events = [e async for e in result.events]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def ids_of(engine: LocalEngine, text: str) -> list[int]:
    return engine.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[no-any-return]


# -- the token -> bytes mapping -------------------------------------------------------------------------------


def test_token_bytes_come_from_the_vocabulary(engine: LocalEngine) -> None:
    tokenizer = engine.loaded.tokenizer
    texts = token_texts(tokenizer)
    ids = ids_of(engine, JAPANESE)
    raw = [texts.raw(t) for t in ids]
    assert b"".join(raw) == JAPANESE.encode("utf-8")
    split = [(t, r) for t, r in zip(ids, raw) if not _valid(r)]
    assert len(split) >= 5, "the test needs tokens that hold part of a character"
    for t, r in split:
        assert texts.token(t) == "bytes:" + "".join(f"\\x{b:02x}" for b in r)
        assert "\ufffd" not in texts.token(t)
    assert texts.token(ids_of(engine, " hello")[0]) == " hello"
    # every token of the vocabulary renders to its own text (the completions top_logprobs keys stay distinct)
    rendered = {texts.token(i) for i in range(len(tokenizer))}
    assert len(rendered) == len(tokenizer)
    # special tokens: their own text; they add nothing to returned text (it skips them)
    eos = int(tokenizer.eos_token_id)
    assert texts.raw(eos) == str(tokenizer.eos_token).encode() and texts.returned(eos) == b""
    # the pieces each token completes join to the decoded text; a partial token completes nothing
    pieces = text_pieces(tokenizer, ids)
    assert "".join(pieces) == JAPANESE
    assert raw[:2] == [b"\xe3\x81", b"\x82"] and pieces[:2] == ["", "あ"]


def _valid(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_text_stream_is_the_tokenizers_streaming_decoder(engine: LocalEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Incremental detokenisation never decodes the whole id list again (it used to at every token: O(n^2))."""
    tokenizer = engine.loaded.tokenizer
    ids = ids_of(engine, JAPANESE * 20)
    calls: list[int] = []
    original = type(tokenizer).decode

    def counting(self: Any, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(token_ids) if isinstance(token_ids, list) else 1)
        return original(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "decode", counting)
    stream = TextStream(tokenizer)
    assert stream._rust is not None  # tokenizers.decoders.DecodeStream
    chunks = [stream.step(t) for t in ids]
    assert "".join(c or "" for c in chunks) == JAPANESE * 20 and stream.rest() == ""
    assert calls == []
    # the Python fallback (a tokenizer without a Rust backend) emits the same chunks, decoding short windows only
    fallback = TextStream(tokenizer)
    fallback._rust = None
    assert [fallback.step(t) for t in ids] == chunks
    assert max(calls) <= 8
    calls.clear()
    out = _Output(tokenizer, ("never",), 0)
    for t in ids:
        out.add(t, None)
        out.pending()
    assert out.finish("length").finish_reason == "length" and out.text == JAPANESE * 20
    assert calls == []


# -- the engine: logprobs of split characters, and a stop string cutting a token ----------------------------


def drive(engine: LocalEngine, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[str, list[TokenLogprob], int]:
    """Feed ``ids`` through the generation output (logprobs over random logits, top 5): text, logprobs, count."""
    texts = token_texts(engine.loaded.tokenizer)
    out = _Output(engine.loaded.tokenizer, stop, 0)
    torch.manual_seed(0)
    deltas = []
    for t in ids:
        out.add(t, logprobs_of(torch.randn(engine.vocab_size), t, 5, texts))
        if out.stop_at is not None:
            break
        if (d := out.pending()) is not None:
            deltas.append(d)
    deltas.append(out.finish("stop" if out.stop_at is not None else "length"))
    text = "".join(d.text for d in deltas)
    return text, [lp for d in deltas for lp in d.logprobs], sum(d.generated_tokens for d in deltas)


def test_logprobs_of_split_characters_carry_their_own_bytes(engine: LocalEngine) -> None:
    ids = ids_of(engine, JAPANESE)
    text, lps, generated = drive(engine, ids)
    assert text == JAPANESE and generated == len(lps) == len(ids)
    assert b"".join(lp.token_bytes for lp in lps) == JAPANESE.encode("utf-8")
    assert "".join(lp.text or "" for lp in lps) == JAPANESE
    assert all("\ufffd" not in lp.token for lp in lps)
    assert any(lp.token.startswith("bytes:\\x") for lp in lps)
    for lp in lps:
        assert len(lp.top) == len(lp.top_bytes) == 5
        assert len({t for _, t, _ in lp.top}) == 5
        assert [token_texts(engine.loaded.tokenizer).raw(i) for i, _, _ in lp.top] == list(lp.top_bytes)


def test_a_stop_string_inside_a_multibyte_run_cuts_the_token_and_counts_every_token(engine: LocalEngine) -> None:
    ids = ids_of(engine, JAPANESE)
    stop = "語 😀"  # begins inside the run of tokens holding 語 and ends inside the emoji's
    text, lps, generated = drive(engine, ids, (stop,))
    expected = JAPANESE[: JAPANESE.index(stop)]
    assert text == expected
    assert b"".join(lp.token_bytes for lp in lps) == expected.encode("utf-8")
    assert "".join(lp.text or "" for lp in lps) == expected
    # every token up to the one that completed the stop string was generated
    decoded = [engine.loaded.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    assert generated == next(k for k, d in enumerate(decoded) if stop in d)
    assert generated > len(lps)


# -- the services: a stop string that begins inside a token ----------------------------------------------------


def straddling_stop(engine: LocalEngine, ids: list[int]) -> tuple[str, int]:
    """A stop string that begins after the first character of token ``k`` and ends inside token ``k + 1`` (the
    earliest such ``k``): the returned text ends inside token ``k``."""
    decoded = [str(engine.decode(ids[:k])) for k in range(len(ids) + 1)]
    for k in range(len(ids) - 1):
        a, b, c = decoded[k], decoded[k + 1], decoded[k + 2]
        if len(b) - len(a) >= 2 and len(c) > len(b) and "\ufffd" not in c and b.startswith(a) and c.startswith(b):
            stop = c[len(a) + 1 : len(b) + 1]
            if c.find(stop) == len(a) + 1 and stop.strip():
                return stop, k
    raise AssertionError("no token boundary to straddle")


async def test_chat_stop_inside_a_token_counts_the_generated_tokens(engine: LocalEngine, ctx: ServiceContext) -> None:
    """The issue's example: the model answers "Hello there", ``stop`` "lo th" returns "Hel"."""
    hello, there = ids_of(engine, "Hello there")
    last = engine.tokenize_chat(MESSAGES)[-1]
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 12,
        "stop": ["lo th"],
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    with scripted(engine, {last: hello, hello: there}, int(engine.loaded.tokenizer.eos_token_id), []):
        plain = await run(chat, ctx, {**body, "stop": None})
        result = await run(chat, ctx, body)
        chunks = await run_stream(chat, ctx, body)
    assert plain.body["choices"][0]["message"]["content"] == "Hello there"
    assert plain.body["usage"]["completion_tokens"] == 2 * 3  # "Hello", " there", the end of sequence
    usage = result.body["usage"]
    assert usage["completion_tokens"] == 2 * 2 == result.completion_tokens  # "Hello" and " there", in both choices
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    expected, k = "Hel", 0
    for choice in result.body["choices"]:
        assert choice["message"]["content"] == expected and choice["finish_reason"] == "stop"
        content = choice["logprobs"]["content"]
        assert [(t["token"], t["bytes"]) for t in content] == [("Hel", list(b"Hel"))]
        assert b"".join(bytes(t["bytes"]) for t in content) == expected.encode("utf-8")
        assert content[0]["top_logprobs"][0]["token"] == "Hello"  # the alternatives stay whole tokens
    # streamed: the same text, logprobs and usage
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * (k + 2)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in mine) == expected
        streamed = [t for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert streamed == result.body["choices"][i]["logprobs"]["content"]


async def test_completion_stop_inside_a_token_counts_the_generated_tokens(
    engine: LocalEngine, ctx: ServiceContext
) -> None:
    prompt = "Once upon a time"
    full = await engine.generate(GenerationRequest(tuple(engine.tokenize(prompt)), SamplingParams(12, 0.0)))
    ids = full.sequences[0].token_ids
    stop, k = straddling_stop(engine, ids)
    expected = full.sequences[0].text[: len(engine.decode(ids[:k])) + 1]
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 12, "stop": stop, "n": 2, "logprobs": 3}
    result = await run(completions, ctx, body)
    assert result.body["usage"]["completion_tokens"] == 2 * (k + 2) == result.completion_tokens
    for choice in result.body["choices"]:
        assert choice["text"] == expected and choice["finish_reason"] == "stop"
        lp = choice["logprobs"]
        assert "".join(lp["tokens"]) == expected and len(lp["tokens"]) == k + 1
        assert lp["text_offset"] == [len("".join(lp["tokens"][:j])) for j in range(k + 1)]
    chunks = await run_stream(completions, ctx, body)
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * (k + 2)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == expected
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert offsets == result.body["choices"][i]["logprobs"]["text_offset"]


# -- the services: logprobs of tokens that hold part of a character ---------------------------------------------


@contextmanager
def scripted(engine: LocalEngine, follow: dict[int, int], default: int, runners_up: list[int]) -> Iterator[None]:
    """Make the tiny model's greedy choice ``follow[last token]`` (else ``default``), with ``runners_up`` close
    behind it in that order (a forward hook on the generation passes)."""

    def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = args[0]
        choice = follow.get(int(ids[0, -1].item()), default)
        for rank, token in enumerate([choice, *runners_up]):
            output.logits[..., token] += 100.0 - rank
        return output

    handle = engine.loaded.model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture
def writes_japanese(engine: LocalEngine) -> Iterator[None]:
    """Make the tiny model write "あああ..." greedily: after the token of bytes E3 81 the token of byte 82, else
    E3 81; four other one-byte tokens (lone bytes of multi-byte characters) follow close behind, so every top-5
    list holds only tokens that a decoder shows as U+FFFD."""
    first, second = ids_of(engine, "あ")
    texts = token_texts(engine.loaded.tokenizer)
    others = [i for i in range(1000) if len(texts.raw(i)) == 1 and texts.raw(i)[0] >= 0x80 and i != second][:4]
    with scripted(engine, {first: second}, first, others):
        yield


async def test_chat_logprobs_of_split_characters(ctx: ServiceContext, writes_japanese: None) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 5,
    }
    result = await run(chat, ctx, body)
    choice = result.body["choices"][0]
    assert choice["message"]["content"] == "あああ"
    content = choice["logprobs"]["content"]
    assert [t["token"] for t in content] == ["bytes:\\xe3\\x81", "bytes:\\x82"] * 3
    assert [t["bytes"] for t in content] == [[0xE3, 0x81], [0x82]] * 3
    assert b"".join(bytes(t["bytes"]) for t in content).decode("utf-8") == "あああ"
    for t in content:
        assert len({a["token"] for a in t["top_logprobs"]}) == 5
        assert all("\ufffd" not in a["token"] for a in t["top_logprobs"])
        assert t["top_logprobs"][0]["token"] == t["token"] and t["top_logprobs"][0]["logprob"] == t["logprob"]
    chunks = await run_stream(chat, ctx, body)
    streamed = [
        t
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content


async def test_completion_logprobs_of_split_characters(ctx: ServiceContext, writes_japanese: None) -> None:
    body = {
        "model": "tiny",
        "prompt": "English: thank you\nJapanese:",
        "temperature": 0,
        "max_tokens": 3,
        "logprobs": 5,
    }
    result = await run(completions, ctx, body)
    choice = result.body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "あ\ufffd"  # the third token starts a character that never ends
    # one representation of a token everywhere: tokens[i] is the key of the chosen token among top_logprobs[i]
    assert lp["tokens"] == ["bytes:\\xe3\\x81", "bytes:\\x82", "bytes:\\xe3\\x81"]
    assert lp["text_offset"] == [0, 0, 1]  # where each token's piece of the text begins ("", "あ", the cut rest)
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 5  # one key per token: none collide as U+FFFD
        assert top[token] == value == max(top.values())  # the greedy token is the top one, under its own key
    assert [next(iter(top)) for top in lp["top_logprobs"]] == ["bytes:\\xe3\\x81", "bytes:\\x82", "bytes:\\xe3\\x81"]
    assert all(key.startswith("bytes:\\x") for top in lp["top_logprobs"] for key in top)
    assert lp["top_logprobs"][0]["bytes:\\xe3\\x81"] == lp["token_logprobs"][0]
    chunks = await run_stream(completions, ctx, body)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    assert [t for s in streamed for t in s["top_logprobs"]] == lp["top_logprobs"]


async def test_echo_prompt_logprobs_of_split_characters(engine: LocalEngine, ctx: ServiceContext) -> None:
    """The scoring (prompt-logprob) path: each token is its own text (the key it would have among the top ones),
    ``text_offset`` says where its piece of the echoed text begins, every top dict holds its 5 tokens, the prompt
    token's entry (where it is among the top 5) equals its logprob."""
    prompt = "English: thank you\nJapanese: " + JAPANESE
    ids = engine.tokenize(prompt)
    for max_tokens in (0, 2):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 5, "seed": 1}
        result = await run(completions, ctx, body)
        choice = result.body["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert all(o <= len(choice["text"]) for o in lp["text_offset"])
        assert all(len(top) == 5 for top in lp["top_logprobs"][1:])
    texts = token_texts(engine.loaded.tokenizer)
    result = await run(completions, ctx, {**body, "max_tokens": 0})
    lp = result.body["choices"][0]["logprobs"]
    assert lp["tokens"][1 : len(ids)] == [texts.token(i) for i in ids[1:]]
    for pos in range(1, len(ids)):
        own = texts.token(ids[pos])
        if own in lp["top_logprobs"][pos]:
            assert lp["top_logprobs"][pos][own] == lp["token_logprobs"][pos]


# -- usage ------------------------------------------------------------------------------------------------------


async def test_usage_carries_openai_details(ctx: ServiceContext) -> None:
    details = {
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "seed": 1}
    answer = (await run(chat, ctx, body)).body
    assert {k: answer["usage"][k] for k in details} == details
    parsed = openai.types.chat.ChatCompletion.model_validate(answer)
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0
    assert parsed.usage.completion_tokens_details is not None
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 0
    streamed = (await run_stream(chat, ctx, body))[-1]
    assert {k: streamed["usage"][k] for k in details} == details
    assert openai.types.chat.ChatCompletionChunk.model_validate(streamed).usage == parsed.usage
    text = (await run(completions, ctx, {"model": "tiny", "prompt": "Once", "max_tokens": 3, "seed": 1})).body
    assert {k: text["usage"][k] for k in details} == details
    completion = openai.types.Completion.model_validate(text)
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    streamed = (await run_stream(completions, ctx, {"model": "tiny", "prompt": "Once", "max_tokens": 3}))[-1]
    assert {k: streamed["usage"][k] for k in details} == details


# -- the batch-line twins: a batch row runs the same service code, its usage is what a batch sums -------------------


async def test_batch_rows_count_tokens_as_the_synchronous_route(engine: LocalEngine, ctx: ServiceContext) -> None:
    hello, there = ids_of(engine, "Hello there")
    last = engine.tokenize_chat(MESSAGES)[-1]
    generating = {
        "model": "tiny",
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 12,
        "stop": ["lo th"],
        "logprobs": True,
    }
    scoring = {**generating, "max_tokens": 1, "stop": ["lo"]}  # one forward pass: packable

    def boost_hello(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        output[..., hello] += 100.0  # on the LM head: the packed scoring pass reads it too
        return output

    batch_call = Call(strict=True, priority=Priority.BATCH)
    with scripted(engine, {last: hello, hello: there}, int(engine.loaded.tokenizer.eos_token_id), []):
        sync = [await run(chat, ctx, generating)]
        plain = [o async for o in chat.create_many(ctx, [generating], batch_call, None)]
    head = engine.loaded.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
    handle = head.register_forward_hook(boost_hello)
    try:
        sync.append(await run(chat, ctx, scoring))
        plain += [o async for o in chat.create_many(ctx, [scoring], batch_call, None)]
        packed = [o async for o in chat.create_many(ctx, [scoring, scoring], batch_call, budget_plan)]
    finally:
        handle.remove()
    assert [s.completion_tokens for s in sync] == [2, 1]
    assert [s.body["choices"][0]["message"]["content"] for s in sync] == ["Hel", "Hel"]
    for outcome, expected in [*zip(plain, sync, strict=True), *((o, sync[1]) for o in packed)]:
        assert isinstance(outcome.result, ServiceResult)
        assert outcome.result.completion_tokens == expected.completion_tokens
        assert outcome.result.body["usage"] == expected.body["usage"]
        assert outcome.result.body["choices"][0]["message"] == expected.body["choices"][0]["message"]
        lp = outcome.result.body["choices"][0]["logprobs"]["content"]
        assert [(t["token"], t["bytes"]) for t in lp] == [("Hel", list(b"Hel"))]
    assert any(o.packed for o in packed)


def budget_plan(lengths: Sequence[int]) -> list[list[int]]:
    return budget_packs(lengths, 4096)


@pytest.mark.slow
async def test_the_issue_examples_on_the_real_model() -> None:
    """Issue 10 items 2 and 3 as reported, on the embedded SmolLM2 (greedy, float32, CPU)."""
    real = await LocalEngine.start(EMBEDDED_MODEL_ID, cache_dir=default_cache_dir())
    try:
        ctx = ServiceContext(engine=real, gate=AdmissionGate(1), rng=random.Random(0))
        model = EMBEDDED_MODEL_ID
        hello = [{"role": "user", "content": "Reply with exactly these two words: Hello there"}]
        body = {"model": model, "messages": hello, "temperature": 0, "max_tokens": 20, "logprobs": True}
        plain = await run(chat, ctx, body)
        assert plain.body["choices"][0]["message"]["content"].startswith("Hello there")
        stopped = (await run(chat, ctx, {**body, "stop": ["lo th"]})).body
        assert stopped["choices"][0]["message"]["content"] == "Hel"
        assert stopped["usage"]["completion_tokens"] == 2  # "Hello" and " there"
        assert [(t["token"], t["bytes"]) for t in stopped["choices"][0]["logprobs"]["content"]] == [
            ("Hel", list(b"Hel"))
        ]
        thanks = [{"role": "user", "content": "Write thank you in Japanese."}]
        answer = (await run(chat, ctx, {**body, "messages": thanks, "max_tokens": 30})).body["choices"][0]
        content = answer["logprobs"]["content"]
        assert b"".join(bytes(t["bytes"]) for t in content) == answer["message"]["content"].encode("utf-8")
        assert all("\ufffd" not in t["token"] for t in content)
        assert any(t["token"].startswith("bytes:\\x") for t in content)
        text_body = {
            "model": model,
            "prompt": "English: thank you\nJapanese:",
            "temperature": 0,
            "max_tokens": 3,
            "logprobs": 5,
        }
        choice = (await run(completions, ctx, text_body)).body["choices"][0]
        lp = choice["logprobs"]
        assert all(0 <= o <= len(choice["text"]) for o in lp["text_offset"])
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert len(top) == 5 and top[token] == value == max(top.values())  # the chosen token, found by its key
    finally:
        await real.close()
