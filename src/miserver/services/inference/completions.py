"""``POST /v1/completions`` (text completions) on the resident model: one code path for the route and batch rows.

Scoring mode (DESIGN §3.4): a request with ``max_tokens`` 0 or 1 needs at most one forward pass over each prompt
(``Engine.score``); with ``echo`` and ``logprobs`` it also reports every prompt token's logprob, the first one null
(OpenAI's shape). Such rows pack in a ``pack: true`` batch (:func:`create_many`); longer generations run alone.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from ...clock import now
from ...engines.adapter import generation_request
from ...engines.base import Engine, GeneratedSequence, GenerationRequest, ScoreRequest, ScoreResult, TokenLogprob
from ...engines.upstream import UpstreamPool
from ...errors import InvalidRequestError, UnsupportedParameterError
from ...ids import random_id
from ...protocol.common import Usage
from ...protocol.completions import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from ...protocol.parsing import carried_fields, parse_request
from . import routing
from .checks import check_context, check_stop, check_stream_options, refuse_unsupported
from .constraints import logit_bias_pairs
from .context import Call, ServiceContext, ServiceResult, StreamResult, StreamUsage, provenance_headers
from .many import Outcome, Packing, Plan, run_many

#: Fields the resident engine cannot honour (refused unless neutral; relayed as they are to an upstream).
UNSUPPORTED_FIELDS = ("best_of",)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[CompletionRequest, Engine | UpstreamPool]:
    """Parse and check a request body without running it (batch validation calls this): :func:`check_local`, or,
    for a model served by an upstream pool, :func:`parse` and the upstream context check (returns the pool)."""
    return routing.route_check(ctx, body, strict, parse, check_local)


def check_local(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[CompletionRequest, Engine]:
    """Parse and check a request body for the resident engine without running it (batch validation calls this too):
    the fields it cannot honour are refused and ``logit_bias`` keys must be its token ids.

    Raises :class:`~miserver.errors.APIError` (400 schema/unknown/unsupported/bad ``logit_bias``, 404
    ``model_not_found``).
    """
    req = parse(body, strict=strict)
    engine = ctx.resolve_model(req.model)
    refuse_unsupported(carried_fields(req, UNSUPPORTED_FIELDS))
    if req.suffix:
        raise UnsupportedParameterError("Unsupported parameter: 'suffix' is not supported.", param="suffix")
    logit_bias_pairs(req.logit_bias, engine)
    return req, engine


def parse(body: Any, *, strict: bool) -> CompletionRequest:
    """The checks of a body that need no model (an upstream model's request gets these, then goes upstream with
    every field as sent).

    Raises :class:`~miserver.errors.APIError` (400) as :func:`check` does.
    """
    req = parse_request(CompletionRequest, body, strict=strict)
    check_stop(req.stop)
    check_stream_options(req.stream, req.stream_options)
    if isinstance(req.prompt, list) and len(req.prompt) == 0:
        raise InvalidRequestError("Invalid 'prompt': it must not be empty.", param="prompt")
    return req


def _prompts(engine: Engine, req: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt; token-id prompts are checked against the vocabulary."""
    p = req.prompt
    if isinstance(p, str):
        return [engine.tokenize(p)]
    if all(isinstance(x, str) for x in p):
        return [engine.tokenize(x) for x in p if isinstance(x, str)]
    # one token-id list, or several (the request model admits no mix)
    flat = [x for x in p if isinstance(x, int)]
    lists = [flat] if len(flat) == len(p) else [x for x in p if isinstance(x, list)]
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


@dataclass
class _Prepared:
    """A checked, tokenised request: one generation request per prompt, and ``prompt_k`` (the top alternatives of
    the prompt logprobs, or None when ``echo`` with ``logprobs`` was not asked)."""

    req: CompletionRequest
    engine: Engine
    gens: list[GenerationRequest]
    prompt_k: int | None
    headers: dict[str, str]
    completion_id: str

    @property
    def scoring(self) -> bool:
        """Scoring mode: at most one forward pass over each prompt; packable in a batch."""
        return self.gens[0].params.max_tokens <= 1 and not self.req.stream


def _prepare(ctx: ServiceContext, body: Any, call: Call) -> _Prepared:
    """Check, tokenise, check the context length and pick the seed (raises :class:`~miserver.errors.APIError`)."""
    req, engine = check_local(ctx, body, strict=call.strict)
    prompts = _prompts(engine, req)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    prompt_k = req.logprobs if req.echo else None
    for ids in prompts:
        check_context(len(ids), max_tokens, engine.info.context_length, param="prompt")
        if not ids and (max_tokens > 0 or prompt_k is not None):
            raise InvalidRequestError("Invalid 'prompt': it has no tokens.", param="prompt")
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
            logit_bias=logit_bias_pairs(req.logit_bias, engine),
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            priority=call.priority,
            fairness_key=call.fairness_key,
            invariant=call.invariant,
        )
        for ids in prompts
    ]
    headers = provenance_headers(engine, seed_header, call.lease, invariant=call.invariant)
    return _Prepared(req, engine, gens, prompt_k, headers, random_id("cmpl-"))


def _prompt_only(gen: GenerationRequest) -> GenerationRequest:
    """``gen`` with no token to generate (for the prompt logprobs of a longer generation)."""
    return replace(gen, params=replace(gen.params, max_tokens=0))


async def _run_prompt(p: _Prepared, gen: GenerationRequest) -> ScoreResult:
    """One prompt alone: one scoring pass in scoring mode; else generation (after a prompt pass for echo logprobs)."""
    if p.scoring:
        return await p.engine.score(ScoreRequest(gen, p.prompt_k))
    prompt = await p.engine.score(ScoreRequest(_prompt_only(gen), p.prompt_k)) if p.prompt_k is not None else None
    result = await p.engine.generate(gen)
    if prompt is None:
        return ScoreResult(result)
    return ScoreResult(result, prompt.prompt_logprobs, prompt.prompt_tokens)


def _top(lp: TokenLogprob) -> dict[str, float]:
    """The alternatives of one position keyed by token text, one key per token: tokens render distinctly
    (``bytes:\\xNN`` where not valid UTF-8); should two still meet, the later one is keyed ``token_id:N``."""
    top: dict[str, float] = {}
    for token_id, token, value in lp.top:
        top[f"token_id:{token_id}" if token in top else token] = value
    return top


def _logprobs(lps: list[TokenLogprob | None], pieces: list[str], start: int) -> CompletionLogprobs:
    """The ``logprobs`` of a run of positions. ``tokens`` are each token's own text, the very string that keys it
    among ``top_logprobs`` (``bytes:\\xNN`` where its bytes are not valid UTF-8), so a client finds the chosen token
    among the top ones; a position without a logprob (the first prompt token) shows its piece of text. ``pieces``
    are the pieces of text the tokens complete (they join to the text; :attr:`TokenLogprob.text`), and
    ``text_offset`` is where each piece begins, counted from ``start``."""
    offsets = list(itertools.accumulate((len(x) for x in pieces[:-1]), initial=start)) if pieces else []
    return CompletionLogprobs(
        tokens=[piece if lp is None else lp.token for lp, piece in zip(lps, pieces, strict=True)],
        token_logprobs=[None if lp is None else lp.logprob for lp in lps],
        top_logprobs=[None if lp is None else _top(lp) for lp in lps],
        text_offset=offsets,
    )


def _pieces(lps: list[TokenLogprob]) -> list[str]:
    return [lp.token if lp.text is None else lp.text for lp in lps]


def _choice(
    index: int, seq: GeneratedSequence, prefix: str, want_logprobs: bool, scored: ScoreResult
) -> CompletionChoice:
    """One choice. With ``echo`` and ``logprobs`` the logprobs cover the prompt tokens, then the generated ones, and
    ``text_offset`` counts from the start of the echoed text; without ``echo`` it counts from the completion's."""
    logprobs = None
    if want_logprobs and seq.logprobs is not None:
        lps: list[TokenLogprob | None] = []
        pieces: list[str] = []
        start = len(prefix)
        if scored.prompt_logprobs is not None and scored.prompt_tokens is not None:
            lps, pieces, start = list(scored.prompt_logprobs), list(scored.prompt_tokens), 0
        logprobs = _logprobs([*lps, *seq.logprobs], [*pieces, *_pieces(seq.logprobs)], start)
    return CompletionChoice(index=index, text=prefix + seq.text, logprobs=logprobs, finish_reason=seq.finish_reason)


def _build(p: _Prepared, results: list[ScoreResult]) -> ServiceResult:
    """The response from each prompt's result (the same code whether the prompts ran alone or in packs)."""
    choices: list[CompletionChoice] = []
    prompt_tokens = completion_tokens = 0
    for p_index, (gen, scored) in enumerate(zip(p.gens, results)):
        result = scored.generation
        prefix = p.engine.decode(list(gen.prompt_ids)) if p.req.echo else ""
        prompt_tokens += result.prompt_tokens
        completion_tokens += result.completion_tokens
        for seq in result.sequences:
            choices.append(_choice(p_index * gen.n + seq.index, seq, prefix, p.req.logprobs is not None, scored))
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
    model = p.engine.info.model_id
    response = Completion(id=p.completion_id, created=now(), model=model, choices=choices, usage=usage)
    return ServiceResult(200, response.model_dump(), p.headers, prompt_tokens, completion_tokens)


async def create(ctx: ServiceContext, body: Any, call: Call) -> ServiceResult | StreamResult:
    """Run a text completion over every prompt of the request (choices indexed prompt-major, then ``n``); a model
    served by an upstream pool goes there (:func:`~miserver.services.inference.routing.create`)."""
    pool = routing.target(ctx, body)
    if pool is not None:
        return await routing.create(ctx, pool, "/v1/completions", parse(body, strict=call.strict), body, call)
    p = _prepare(ctx, body, call)
    if p.req.stream:
        include_usage = bool(p.req.stream_options and p.req.stream_options.include_usage)
        counted = StreamUsage()
        return StreamResult(_stream(ctx, p, call, include_usage, counted), p.headers, counted)
    return await _execute(ctx, p, call)


async def _execute(ctx: ServiceContext, p: _Prepared, call: Call) -> ServiceResult:
    """The computation of a prepared, non-streamed request under the admission gate (or ``call.slot``)."""
    async with ctx.gate.hold(call.priority, call.slot):
        results = [await _run_prompt(p, gen) for gen in p.gens]
    return _build(p, results)


PACKING: Packing[_Prepared, ScoreRequest, ScoreResult] = Packing(
    prepare=_prepare,
    units=lambda p: [ScoreRequest(g, p.prompt_k) for g in p.gens] if p.scoring else None,
    build=_build,
    run_pack=lambda engine, units: engine.score_many(units),
    run_one=lambda engine, unit: engine.score(unit),
    execute=_execute,
    # echo with logprobs needs a scoring pass over the prompt as well: such a row runs alone
    generations=lambda p: None if p.scoring or p.req.stream or p.prompt_k is not None else list(p.gens),
    build_generated=lambda p, results: _build(p, [ScoreResult(r) for r in results]),
)


def create_many(ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None) -> AsyncIterator[Outcome]:
    """Many rows of the resident engine at once (the registry routes upstream rows first, see
    ``upstream_rows.routed_many``): in a ``pack: true`` batch every prompt of every
    scoring-mode row in the packs ``plan`` makes (``Engine.score_many``); other rows one at a time through
    :func:`create`. Yields every row once."""
    return run_many(PACKING, ctx, bodies, call, plan)


async def _stream(
    ctx: ServiceContext, p: _Prepared, call: Call, include_usage: bool, counted: StreamUsage
) -> AsyncIterator[str]:
    created = now()
    req, engine = p.req, p.engine
    model = engine.info.model_id

    def event(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        c = Completion(id=p.completion_id, created=created, model=model, choices=choices, usage=usage)
        return json.dumps(c.model_dump())

    prompt_tokens = completion_tokens = 0
    next_offset: dict[int, int] = {}  # choice index -> text_offset of its next token
    async with ctx.gate.hold(call.priority, call.slot):
        for p_index, gen in enumerate(p.gens):
            prompt_tokens += len(gen.prompt_ids)
            if req.echo:
                prefix = engine.decode(list(gen.prompt_ids))
                echoed, echoed_chars = None, 0
                if p.prompt_k is not None:
                    scored = await engine.score(ScoreRequest(_prompt_only(gen), p.prompt_k))
                    assert scored.prompt_logprobs is not None and scored.prompt_tokens is not None
                    echoed = _logprobs(list(scored.prompt_logprobs), list(scored.prompt_tokens), 0)
                    echoed_chars = sum(len(piece) for piece in scored.prompt_tokens)
                for i in range(gen.n):
                    index = p_index * gen.n + i
                    choice = CompletionChoice(index=index, text=prefix, logprobs=echoed, finish_reason=None)
                    next_offset[index] = len(prefix) if echoed is None else echoed_chars
                    yield event([choice])
            async for delta in engine.generate_stream(gen):
                completion_tokens += delta.generated_tokens
                counted.progress(prompt_tokens, completion_tokens)
                index = p_index * gen.n + delta.index
                logprobs = None
                if req.logprobs is not None and delta.logprobs:
                    pieces = _pieces(list(delta.logprobs))
                    start = next_offset.get(index, 0)
                    logprobs = _logprobs(list(delta.logprobs), pieces, start)
                    next_offset[index] = start + sum(len(x) for x in pieces)
                finish = delta.finish_reason
                yield event([CompletionChoice(index=index, text=delta.text, logprobs=logprobs, finish_reason=finish)])
    counted.set(prompt_tokens, completion_tokens)
    if include_usage:
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        yield event([], usage)
    yield "[DONE]"
