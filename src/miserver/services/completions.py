"""``POST /v1/completions`` (text completions) on the resident model: one code path for the route and batch rows."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ..engines.adapter import generation_request
from ..engines.base import Engine, GenerationRequest, Sequence_
from ..errors import InvalidRequestError, UnsupportedParameterError
from ..ids import now, random_id
from ..protocol.common import Usage, parse_request
from ..protocol.completions import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from .common import check_context, check_stop, check_stream_options, refuse_unsupported
from .context import Call, ServiceContext, ServiceResult, StreamResult, provenance_headers

UNSUPPORTED_FIELDS = ("frequency_penalty", "presence_penalty", "logit_bias", "best_of")
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[CompletionRequest, Engine]:
    """Parse and check a request body without running it (batch validation calls this too).

    Raises :class:`~miserver.errors.APIError` (400 schema/unknown/unsupported, 404 ``model_not_found``).
    """
    req = parse_request(CompletionRequest, body, strict=strict)
    refuse_unsupported({name: getattr(req, name) for name in UNSUPPORTED_FIELDS})
    if req.suffix:
        raise UnsupportedParameterError("Unsupported parameter: 'suffix' is not supported.", param="suffix")
    check_stop(req.stop)
    check_stream_options(req.stream, req.stream_options)
    if req.echo and req.logprobs is not None:
        raise UnsupportedParameterError(
            "Unsupported parameter: 'echo' with 'logprobs' (prompt logprobs) is not supported yet.", param="echo"
        )
    if isinstance(req.prompt, list) and len(req.prompt) == 0:
        raise InvalidRequestError("Invalid 'prompt': it must not be empty.", param="prompt")
    engine = ctx.resolve_model(req.model)
    return req, engine


def _prompts(engine: Engine, req: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt; token-id prompts are checked against the vocabulary."""
    p = req.prompt
    if isinstance(p, str):
        return [engine.tokenize(p)]
    if all(isinstance(x, str) for x in p):
        return [engine.tokenize(x) for x in p]  # type: ignore[arg-type]
    lists: list[list[int]] = [p] if all(isinstance(x, int) for x in p) else list(p)  # type: ignore[list-item]
    vocab = engine.vocab_size
    for i, ids in enumerate(lists):
        if not ids:
            raise InvalidRequestError("Invalid 'prompt': a token list must not be empty.", param=f"prompt[{i}]")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"Invalid 'prompt': token id {bad[0]} is outside the vocabulary (0-{vocab - 1}).", param="prompt"
            )
    return lists


def _choice(index: int, seq: Sequence_, prefix: str, want_logprobs: bool) -> CompletionChoice:
    logprobs = None
    if want_logprobs and seq.logprobs is not None:
        offset, offsets = len(prefix), []
        for lp in seq.logprobs:
            offsets.append(offset)
            offset += len(lp.token)
        logprobs = CompletionLogprobs(
            tokens=[lp.token for lp in seq.logprobs],
            token_logprobs=[lp.logprob for lp in seq.logprobs],
            top_logprobs=[{t: v for _, t, v in lp.top} for lp in seq.logprobs],
            text_offset=offsets,
        )
    return CompletionChoice(index=index, text=prefix + seq.text, logprobs=logprobs, finish_reason=seq.finish_reason)


async def create(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
    """Run a text completion over every prompt of the request (choices indexed prompt-major, then ``n``)."""
    req, engine = check(ctx, body, strict=call.strict)
    prompts = _prompts(engine, req)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    for ids in prompts:
        check_context(len(ids), max_tokens, engine.info.context_length, param="prompt")
    seed, seed_header = ctx.pick_seed(req.seed)
    gens = [
        generation_request(
            ids,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stop=req.stop,
            seed=seed,
            logprobs=req.logprobs,
            n=req.n,
        )
        for ids in prompts
    ]
    headers = provenance_headers(engine, seed_header, call.lease)
    completion_id = random_id("cmpl-")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamResult(_stream(ctx, engine, req, gens, call, completion_id, include_usage), headers)
    choices: list[CompletionChoice] = []
    prompt_tokens = completion_tokens = 0
    async with ctx.gate.hold(call.priority, call.slot):
        for p_index, gen in enumerate(gens):
            result = await engine.generate(gen)
            prefix = engine.decode(list(gen.prompt_ids)) if req.echo else ""
            prompt_tokens += result.prompt_tokens
            completion_tokens += result.completion_tokens
            for seq in result.sequences:
                choices.append(_choice(p_index * gen.n + seq.index, seq, prefix, req.logprobs is not None))
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
    response = Completion(id=completion_id, created=now(), model=engine.info.model_id, choices=choices, usage=usage)
    return ServiceResult(200, response.model_dump(), headers, prompt_tokens, completion_tokens)


async def _stream(
    ctx: ServiceContext,
    engine: Engine,
    req: CompletionRequest,
    gens: list[GenerationRequest],
    call: Call,
    completion_id: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = now()
    model = engine.info.model_id

    def event(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        c = Completion(id=completion_id, created=created, model=model, choices=choices, usage=usage)
        return json.dumps(c.model_dump())

    prompt_tokens = completion_tokens = 0
    async with ctx.gate.hold(call.priority, call.slot):
        for p_index, gen in enumerate(gens):
            prompt_tokens += len(gen.prompt_ids)
            if req.echo:
                prefix = engine.decode(list(gen.prompt_ids))
                for i in range(gen.n):
                    yield event([CompletionChoice(index=p_index * gen.n + i, text=prefix, logprobs=None, finish_reason=None)])
            async for delta in engine.generate_stream(gen):
                completion_tokens += len(delta.token_ids)
                index = p_index * gen.n + delta.index
                logprobs = None
                if req.logprobs is not None and delta.logprobs:
                    logprobs = CompletionLogprobs(
                        tokens=[lp.token for lp in delta.logprobs],
                        token_logprobs=[lp.logprob for lp in delta.logprobs],
                        top_logprobs=[{t: v for _, t, v in lp.top} for lp in delta.logprobs],
                        text_offset=[0 for _ in delta.logprobs],
                    )
                yield event(
                    [CompletionChoice(index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason)]
                )
    if include_usage:
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        yield event([], usage)
    yield "[DONE]"
