"""``POST /v1/chat/completions`` on the resident model: the one code path for the route and for batch rows."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from ...clock import now
from ...engines.adapter import generation_request, normalise_stop
from ...engines.base import (
    Engine,
    GenerationRequest,
    GenerationResult,
    Grammar,
    ScoreRequest,
    ScoreResult,
    TokenLogprob,
)
from ...engines.upstream import UpstreamPool
from ...errors import InvalidRequestError, MissingParameterError
from ...ids import random_id
from ...protocol.chat import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    ChunkToolCall,
    FunctionCall,
    ToolCallOut,
)
from ...protocol.common import ChatTokenLogprob, TopLogprob, Usage
from ...protocol.parsing import carried_fields, parse_request
from . import routing
from .checks import (
    check_context,
    check_max_tokens,
    check_stop,
    check_stream_options,
    refuse_message_names,
    refuse_unsupported,
)
from .constraints import check_grammar, grammar_of, logit_bias_pairs
from .context import Call, ServiceContext, ServiceResult, StreamResult, StreamUsage, provenance_headers
from .many import Outcome, Packing, Plan, run_many
from .tools import ToolCall, Tools, call_grammar, call_text, parse_call, parse_tools, with_tools

#: Fields the resident engine cannot honour (refused unless neutral; relayed as they are to an upstream).
SCHEMA_PARAM = "response_format.json_schema.schema"
UNSUPPORTED_FIELDS = (
    "functions",
    "function_call",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "store",
    "service_tier",
)


def check(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[ChatCompletionRequest, Engine | UpstreamPool]:
    """Parse and check a request body without running it (batch validation calls this): :func:`check_local`, or,
    for a model served by an upstream pool, :func:`parse` and the upstream context check (returns the pool)."""
    return routing.route_check(ctx, body, strict, parse, check_local)


def check_local(ctx: ServiceContext, body: Any, *, strict: bool) -> tuple[ChatCompletionRequest, Engine]:
    """Parse and check a request body for the resident engine without running it (batch validation calls this too):
    the fields it cannot honour are refused, ``logit_bias`` keys must be its token ids, ``tools`` and
    ``tool_choice`` are checked, and the answer's grammar (a ``response_format`` schema, or a forced tool call) is
    compiled (cached for the run).

    Raises :class:`~miserver.errors.APIError`: 400 for schema, unknown (strict) and unsupported fields, a bad
    ``logit_bias`` or schema, 404 ``model_not_found``.
    """
    req = parse(body, strict=strict)
    engine = ctx.resolve_model(req.model)
    refuse_unsupported(carried_fields(req, UNSUPPORTED_FIELDS))
    refuse_message_names(req.messages)
    logit_bias_pairs(req.logit_bias, engine)
    _grammar(engine, req, parse_tools(req.tools, req.tool_choice))
    return req, engine


def _grammar(engine: Engine, req: ChatCompletionRequest, tools: Tools | None) -> Grammar | None:
    """The grammar of the answer, compiled on ``engine`` (cached): a forced tool call's, or the response format's.
    Raises 400 as :func:`~miserver.services.inference.constraints.check_grammar` does, and on ``response_format``
    when both would constrain the answer."""
    answer = grammar_of(req.response_format, param="response_format")
    call = None if tools is None else call_grammar(tools)
    if call is not None and answer is not None:
        raise InvalidRequestError(
            "Invalid 'response_format': it cannot be combined with a 'tool_choice' that forces a tool call (the "
            "call's arguments follow the tool's parameters).",
            param="response_format",
        )
    if call is not None:
        check_grammar(engine, call, field="tools", schema_param="tools")
        return call
    check_grammar(engine, answer, field="response_format", schema_param=SCHEMA_PARAM)
    return answer


def parse(body: Any, *, strict: bool) -> ChatCompletionRequest:
    """The checks of a body that need no model (an upstream model's request gets these, then goes upstream with
    every field as sent: tools, ``logit_bias`` and the rest are the upstream's to honour).

    Raises :class:`~miserver.errors.APIError` (400) as :func:`check` does.
    """
    req = parse_request(ChatCompletionRequest, body, strict=strict)
    grammar_of(req.response_format, param="response_format")
    check_max_tokens(req.max_tokens, req.max_completion_tokens)
    check_stop(req.stop)
    check_stream_options(req.stream, req.stream_options)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    calls: set[str] = set()  # the ids of the tool calls made by earlier assistant turns
    for i, message in enumerate(req.messages):
        if message.role == "tool" and message.tool_call_id and message.tool_call_id not in calls:
            raise InvalidRequestError(
                f"Invalid 'messages[{i}].tool_call_id': {message.tool_call_id!r} answers no tool call of an earlier "
                "assistant turn (a 'tool' turn follows the assistant turn whose 'tool_calls' it answers).",
                param=f"messages[{i}].tool_call_id",
            )
        calls.update(call.id for call in message.tool_calls or [])
        if message.content is None and message.role != "assistant":  # only an assistant turn may omit content
            raise MissingParameterError(
                f"Missing required parameter: 'messages[{i}].content'.", param=f"messages[{i}].content"
            )
        if message.role == "tool" and not message.tool_call_id:
            raise MissingParameterError(
                f"Missing required parameter: 'messages[{i}].tool_call_id'.", param=f"messages[{i}].tool_call_id"
            )
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequestError(
                f"Invalid 'messages[{i}].tool_calls': only an assistant turn carries tool calls.",
                param=f"messages[{i}].tool_calls",
            )
    return req


def _messages(req: ChatCompletionRequest, tools: Tools | None = None) -> list[dict[str, str]]:
    """The turns as the chat template takes them: ``developer`` as ``system``; an assistant turn's tool calls
    written as the calls the model makes (see :mod:`~miserver.services.inference.tools`), after its text; with
    ``tools``, the tool prompt in the system turn."""
    role = {"developer": "system"}
    turns = []
    for m in req.messages:
        content = m.text()
        if m.tool_calls:
            calls = [call_text(c.function.name, c.function.arguments) for c in m.tool_calls]
            content = "\n".join([content, *calls] if content else calls)
        turns.append({"role": role.get(m.role, m.role), "content": content})
    return turns if tools is None else with_tools(turns, tools)


def _logprob(lp: TokenLogprob) -> ChatTokenLogprob:
    """One content token: its text (``bytes:\\xNN`` form where not valid UTF-8) and its share of the content's bytes
    (joined over the message they rebuild the content); alternatives with their own vocabulary bytes."""
    top = [TopLogprob(token=t, logprob=v, bytes=list(b)) for (_, t, v), b in zip(lp.top, lp.top_bytes, strict=True)]
    return ChatTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(lp.token_bytes), top_logprobs=top)


@dataclass
class Extras:
    """What a service that translates another API into a chat request (Anthropic's Messages) asks beyond chat's own
    fields, and what it reads back beyond chat's answer. In: ``stop`` (stop sequences, any number; they replace the
    body's ``stop``) and ``top_k`` (keep the ``top_k`` most likely tokens; None: all). Out: ``matched``, the stop
    sequence that ended each choice (by choice index), filled as the resident engine finishes it. To an upstream
    both go as the chat body's ``stop`` and ``top_k`` (the extension vLLM, SGLang and llama.cpp take)."""

    stop: tuple[str, ...] = ()
    top_k: int | None = None
    matched: dict[int, str] = field(default_factory=dict)

    def relayed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as it goes to an upstream, with ``stop`` and ``top_k``."""
        extra: dict[str, Any] = {"stop": list(self.stop)} if self.stop else {}
        if self.top_k is not None:
            extra["top_k"] = self.top_k
        return {**body, **extra}


@dataclass
class _Prepared:
    """A checked, tokenised request: everything but the engine run."""

    req: ChatCompletionRequest
    engine: Engine
    gen: GenerationRequest
    headers: dict[str, str]
    completion_id: str
    #: the request's tools, when the model may call them (``tool_choice`` other than ``none``)
    tools: Tools | None = None
    #: what a translating service asked beyond chat's fields (see :class:`Extras`)
    extras: Extras | None = None

    def finished(self, index: int, stop_sequence: str | None) -> None:
        """Tell the translating service which stop sequence ended choice ``index`` (if any)."""
        if self.extras is not None and stop_sequence is not None:
            self.extras.matched[index] = stop_sequence

    @property
    def scoring(self) -> bool:
        """Scoring mode (DESIGN §3.4): one token after one forward pass over the prompt; packable in a batch."""
        return self.gen.params.max_tokens == 1 and not self.req.stream


def _prepare(ctx: ServiceContext, body: Any, call: Call, extras: Extras | None = None) -> _Prepared:
    """Check, tokenise, check the context length and pick the seed (raises :class:`~miserver.errors.APIError`);
    ``extras``' stop sequences and ``top_k`` go into the sampling parameters."""
    req, engine = check_local(ctx, body, strict=call.strict)
    tools = parse_tools(req.tools, req.tool_choice)
    prompt = engine.tokenize_chat(_messages(req, tools))
    room = engine.info.context_length - len(prompt)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(room, 1)
    check_context(len(prompt), max_tokens, engine.info.context_length, param="messages")
    seed, seed_header = ctx.pick_seed(req.seed)
    grammar = _grammar(engine, req, tools)
    gen = generation_request(
        prompt,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop,
        seed=seed,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        n=req.n,
        logit_bias=logit_bias_pairs(req.logit_bias, engine),
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        grammar=grammar,
        priority=call.priority,
        fairness_key=call.fairness_key,
        invariant=call.invariant,
    )
    if extras is not None:
        params = replace(gen.params, stop=normalise_stop(list(extras.stop)) or gen.params.stop, top_k=extras.top_k)
        gen = replace(gen, params=params)
    headers = provenance_headers(engine, seed_header, call.lease, invariant=call.invariant, grammar=grammar)
    calling = tools if tools is not None and tools.mode != "none" else None
    return _Prepared(req, engine, gen, headers, random_id("chatcmpl-"), calling, extras)


def _build(p: _Prepared, result: GenerationResult) -> ServiceResult:
    """The response of a finished generation (the same code whether the row ran alone or in a pack)."""
    choices = []
    for s in result.sequences:
        p.finished(s.index, s.stop_sequence)
        made = _tool_call(p, s.text, s.finish_reason)
        choices.append(
            ChatChoice(
                index=s.index,
                message=ChatCompletionMessage(content=s.text)
                if made is None
                else ChatCompletionMessage(content=None, tool_calls=[_tool_call_out(made)]),
                logprobs=ChoiceLogprobs(content=[_logprob(lp) for lp in s.logprobs])
                if s.logprobs is not None
                else None,
                finish_reason=s.finish_reason if made is None else "tool_calls",
            )
        )
    usage = Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    )
    model = p.engine.info.model_id
    response = ChatCompletion(id=p.completion_id, created=now(), model=model, choices=choices, usage=usage)
    return ServiceResult(200, response.model_dump(), p.headers, usage.prompt_tokens, usage.completion_tokens)


def _tool_call(p: _Prepared, text: str, finish_reason: str) -> ToolCall | None:
    """The tool call a finished answer makes, if the request has callable tools and the answer is one."""
    if p.tools is None or finish_reason != "stop":
        return None
    return parse_call(text, p.tools)


def _tool_call_out(made: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=made.id, function=FunctionCall(name=made.name, arguments=made.arguments))


async def create(
    ctx: ServiceContext, body: Any, call: Call, extras: Extras | None = None
) -> ServiceResult | StreamResult:
    """Run a chat completion. Returns a :class:`ServiceResult`, or a :class:`StreamResult` when ``stream`` is true.

    A scoring-mode request (one token) runs through ``Engine.score``, which chooses its token exactly as generation
    does (on the resident engine it is the step loop's one-token generation); any other through
    ``Engine.generate``. A model served by an upstream pool goes there
    (:func:`~miserver.services.inference.routing.create`), with ``extras`` written into the body it sends.
    """
    pool = routing.target(ctx, body)
    if pool is not None:
        req = parse(body, strict=call.strict)
        sent = body if extras is None else extras.relayed(body)
        return await routing.create(ctx, pool, "/v1/chat/completions", req, sent, call)
    p = _prepare(ctx, body, call, extras)
    if p.req.stream:
        include_usage = bool(p.req.stream_options and p.req.stream_options.include_usage)
        counted = StreamUsage()
        events = _stream(ctx, p, call, include_usage, counted)
        return StreamResult(events, p.headers, counted)
    return await _execute(ctx, p, call)


async def _execute(ctx: ServiceContext, p: _Prepared, call: Call) -> ServiceResult:
    """The computation of a prepared, non-streamed request under the admission gate (or ``call.slot``)."""
    return _build(p, await run_prepared(ctx, p, call))


def prepare(ctx: ServiceContext, body: Any, call: Call, extras: Extras | None = None) -> _Prepared:
    """Check and tokenise a chat body, pick its seed and provenance headers (raises ``APIError``), without running
    it: what a translating service reads of the request it would run (Messages' ``count_tokens``)."""
    return _prepare(ctx, body, call, extras)


async def run_prepared(ctx: ServiceContext, p: _Prepared, call: Call) -> GenerationResult:
    """The engine computation of a prepared, non-streamed request under the admission gate (or ``call.slot``): a
    scoring-mode request through ``Engine.score``, any other through ``Engine.generate``."""
    async with ctx.gate.hold(call.priority, call.slot):
        if p.scoring:
            return (await p.engine.score(ScoreRequest(p.gen))).generation
        return await p.engine.generate(p.gen)


def _build_scored(p: _Prepared, results: list[ScoreResult]) -> ServiceResult:
    return _build(p, results[0].generation)


PACKING: Packing[_Prepared, ScoreRequest, ScoreResult] = Packing(
    prepare=_prepare,
    units=lambda p: [ScoreRequest(p.gen)] if p.scoring else None,
    build=_build_scored,
    run_pack=lambda engine, units: engine.score_many(units),
    run_one=lambda engine, unit: engine.score(unit),
    execute=_execute,
    generations=lambda p: None if p.scoring or p.req.stream else [p.gen],
    build_generated=lambda p, results: _build(p, results[0]),
)


def create_many(ctx: ServiceContext, bodies: list[Any], call: Call, plan: Plan | None) -> AsyncIterator[Outcome]:
    """Many rows of the resident engine at once (the registry routes upstream rows first, see
    ``upstream_rows.routed_many``): with ``plan`` None each row as :func:`create` computes
    it; with a planner (``pack: true``) scoring rows in the packs it makes (``Engine.score_many``), other rows one at
    a time. Yields every row at most once (see :func:`~miserver.services.inference.many.run_many`)."""
    return run_many(PACKING, ctx, bodies, call, plan)


async def _stream(
    ctx: ServiceContext, p: _Prepared, call: Call, include_usage: bool, counted: StreamUsage
) -> AsyncIterator[str]:
    """The chunks of a streamed request. With callable tools each choice's text is held until it ends: then it goes
    out as one tool-call delta (``finish_reason: "tool_calls"``) or as one content delta."""
    engine, gen, completion_id = p.engine, p.gen, p.completion_id
    created = now()
    model = engine.info.model_id
    held: dict[int, list[str]] = {}

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        c = ChatCompletionChunk(id=completion_id, created=created, model=model, choices=choices, usage=usage)
        return json.dumps(c.model_dump(exclude_none=False))

    completion_tokens = 0
    async with ctx.gate.hold(call.priority, call.slot):
        for i in range(gen.n):
            yield chunk([ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))])
        async for delta in engine.generate_stream(gen):
            completion_tokens += delta.generated_tokens
            counted.progress(len(gen.prompt_ids), completion_tokens)
            logprobs = (
                ChoiceLogprobs(content=[_logprob(lp) for lp in delta.logprobs])
                if gen.params.logprobs is not None and delta.logprobs
                else None
            )
            if delta.finish_reason is not None:
                p.finished(delta.index, delta.stop_sequence)
            if p.tools is not None:
                held.setdefault(delta.index, []).append(delta.text)
                if delta.finish_reason is None:
                    continue
                text = "".join(held.pop(delta.index))
                made = _tool_call(p, text, delta.finish_reason)
                if made is not None:
                    out = _tool_call_out(made)
                    calls = [ChunkToolCall(index=0, id=out.id, function=out.function)]
                    yield chunk([ChunkChoice(index=delta.index, delta=ChunkDelta(tool_calls=calls))])
                    yield chunk([ChunkChoice(index=delta.index, delta=ChunkDelta(), finish_reason="tool_calls")])
                    continue
                delta = replace(delta, text=text)
            if delta.text or logprobs is not None:
                yield chunk([ChunkChoice(index=delta.index, delta=ChunkDelta(content=delta.text), logprobs=logprobs)])
            if delta.finish_reason is not None:
                yield chunk([ChunkChoice(index=delta.index, delta=ChunkDelta(), finish_reason=delta.finish_reason)])
    prompt_tokens = len(gen.prompt_ids)
    counted.set(prompt_tokens, completion_tokens)
    if include_usage:
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        yield chunk([], usage)
    yield "[DONE]"
