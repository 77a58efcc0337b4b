"""Token-by-token generation in plain PyTorch, gpt-fast style: prefill, decode steps, sampling, detokenising.

Everything here is synchronous and must run under ``torch.inference_mode`` on the engine's thread. Shapes: a prompt
is ``[prompt_len]`` token ids; ``logits`` are always the float32 vector ``[vocab]`` of one position.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from miserver.engines.base import (
    GeneratedSequence,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
)
from miserver.engines.local.detokenize import TokenTexts, _Output
from miserver.engines.local.processors import Grammars, process, processors_for


def prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, Cache]:
    """Run the prompt ``input_ids`` (``[prompt_len]``, long, on the model's device, ``prompt_len >= 1``).

    Returns the float32 logits ``[vocab]`` of the last position and the filled KV cache.
    """
    past = DynamicCache(config=model.config)
    kwargs = {cache_kwarg(type(model)): past}
    out = model(input_ids=input_ids.unsqueeze(0), use_cache=True, logits_to_keep=1, **kwargs)
    return out.logits[0, -1].float(), past  # the cache is filled in place


def decode_step(model: PreTrainedModel, token: int, past: Cache) -> tuple[torch.Tensor, Cache]:
    """Feed one token after ``past``; returns the float32 logits ``[vocab]`` of the next position and the cache."""
    ids = torch.tensor([[token]], dtype=torch.long, device=model.device)
    out = model(input_ids=ids, use_cache=True, **{cache_kwarg(type(model)): past})
    return out.logits[0, -1].float(), past


_CACHE_KWARGS: dict[type, str] = {}


def cache_kwarg(model_type: type) -> str:
    """The name of ``model_type.forward``'s cache argument: ``cache`` in recent transformers 5 releases,
    ``past_key_values`` before (now deprecated)."""
    if model_type not in _CACHE_KWARGS:
        # getattr: ``forward`` is not on ``type`` for the type checker
        params = inspect.signature(getattr(model_type, "forward")).parameters  # noqa: B009
        _CACHE_KWARGS[model_type] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARGS[model_type]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from ``logits`` (``[vocab]``).

    ``temperature`` 0 is argmax, and so is a positive temperature too small for ``logits / temperature`` to stay
    finite (the limit of the softmax as the temperature goes to 0). Otherwise ``softmax(logits / temperature)``
    restricted to the smallest set of most likely tokens whose probability reaches ``top_p`` (at least one token),
    drawn with ``generator``, which must live on the logits' device. A positive ``top_k`` first keeps the ``top_k``
    most likely tokens (renormalised).
    """
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # a temperature so small (1e-300) that logits / temperature overflow: softmax's limit, the most likely token
        return int(torch.argmax(logits))
    if params.top_k is not None and 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum()
    if params.top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=generator))
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    outside = mass_before >= params.top_p
    outside[0] = False  # the top token always stays (so top_p 0 picks the most likely token)
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])


def logprobs_of(logits: torch.Tensor, token_id: int, k: int, texts: TokenTexts) -> TokenLogprob:
    """The chosen token's natural-log probability and the ``k`` most likely alternatives, sorted descending.

    Computed with ``log_softmax`` of the raw ``logits`` (``[vocab]``; before temperature and top_p, as vLLM does by
    default). Tokens are rendered by ``texts`` (:meth:`TokenTexts.token`, :meth:`TokenTexts.raw`); the chosen
    token's ``token_bytes`` are its own bytes until :class:`_Output` knows its share of the returned text.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, str, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logp, k)
        top = tuple((int(i), texts.token(int(i)), float(v)) for v, i in zip(values.tolist(), ids.tolist()))
    return TokenLogprob(
        token_id,
        texts.token(token_id),
        float(logp[token_id]),
        top,
        texts.raw(token_id),
        tuple(texts.raw(t) for t, _, _ in top),
    )


def generate_sequence(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    index: int = 0,
    seed: int | None = None,
    eos_ids: Collection[int] = (),
    max_positions: int | None = None,
    prefilled: tuple[torch.Tensor, Cache] | None = None,
    should_stop: Callable[[], bool] | None = None,
    grammars: Grammars | None = None,
) -> Iterator[StreamDelta]:
    """Generate one sequence, yielding :class:`StreamDelta` pieces; the last one carries the finish reason.

    ``seed`` (default ``params.seed``) seeds a private generator. A token in ``eos_ids`` ends with ``"stop"`` and is
    not returned (but counted in ``generated_tokens``); a stop string ends with ``"stop"`` and the text is cut
    before it (token ids keep the tokens whose text begins before it; the tokens of the stop string are counted in
    ``generated_tokens``); ``params.max_tokens`` tokens, or reaching ``max_positions`` (the context length), end with
    ``"length"``. ``prefilled`` reuses (logits, cache) of the prompt; the cache is extended in place.
    When ``should_stop()`` turns true the iterator ends at the next token without a final delta. Each token is
    sampled from the logits as ``params``' processors leave them (``processors.process``; ``grammars`` compiles a
    grammar). Raises ``ValueError`` for an empty prompt, or a grammar that ``grammars`` cannot compile (or none).
    """
    if params.max_tokens <= 0:
        yield StreamDelta(index, "", finish_reason="length")
        return
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    device = model.device
    limit = params.max_tokens
    if max_positions is not None:
        limit = max(0, min(limit, max_positions - len(prompt_ids)))
    generator = torch.Generator(device=device).manual_seed(params.seed if seed is None else seed)
    proc = processors_for(params, grammars, device)
    logits, past = prefilled or prefill(model, torch.tensor(list(prompt_ids), dtype=torch.long, device=device))
    out = _Output(tokenizer, params.stop, index)
    for step in range(limit):
        if should_stop is not None and should_stop():
            return
        token = sample(process(logits, proc), params, generator)
        if token in eos_ids:
            out.end_token()
            yield out.finish("stop")
            return
        logprob = None if params.logprobs is None else logprobs_of(logits, token, params.logprobs, out.texts)
        if proc is not None:
            proc.accept(token)
        out.add(token, logprob)
        if out.stop_at is not None:
            yield out.finish("stop")
            return
        delta = out.pending()
        if delta is not None:
            yield delta
        if step + 1 < limit:
            logits, past = decode_step(model, token, past)
    yield out.finish("length")


def generate_request(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    request: GenerationRequest,
    *,
    eos_ids: Collection[int] = (),
    max_positions: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[StreamDelta]:
    """All ``request.n`` sequences one after another (sequence ``i`` uses seed ``params.seed + i``).

    The prompt is prefilled once; each sequence but the last decodes from a deep copy of that cache.
    """
    params = request.params
    shared: tuple[torch.Tensor, Cache] | None = None
    if params.max_tokens > 0 and request.prompt_ids:
        ids = torch.tensor(list(request.prompt_ids), dtype=torch.long, device=model.device)
        shared = prefill(model, ids)
    for i in range(request.n):
        if should_stop is not None and should_stop():
            return
        prefilled = None
        if shared is not None:
            prefilled = (shared[0], copy.deepcopy(shared[1]) if i < request.n - 1 else shared[1])
        yield from generate_sequence(
            model,
            tokenizer,
            request.prompt_ids,
            params,
            index=i,
            seed=params.seed + i,
            eos_ids=eos_ids,
            max_positions=max_positions,
            prefilled=prefilled,
            should_stop=should_stop,
        )


def collect_result(deltas: Iterable[StreamDelta], request: GenerationRequest) -> GenerationResult:
    """Join the deltas of ``request``'s ``n`` sequences into a :class:`GenerationResult` (sequences in index order)."""
    want_logprobs = request.params.logprobs is not None
    seqs = [GeneratedSequence(i, [], "", "length", [] if want_logprobs else None) for i in range(request.n)]
    texts: list[list[str]] = [[] for _ in seqs]
    generated = [0] * len(seqs)
    for delta in deltas:
        seq = seqs[delta.index]
        generated[delta.index] += delta.generated_tokens
        texts[delta.index].append(delta.text)
        seq.token_ids.extend(delta.token_ids)
        if seq.logprobs is not None:
            seq.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            seq.finish_reason = delta.finish_reason
            seq.stop_sequence = delta.stop_sequence
    for seq, parts, count in zip(seqs, texts, generated):
        seq.text = "".join(parts)
        seq.generated_tokens = count
    return GenerationResult(sequences=seqs, prompt_tokens=len(request.prompt_ids))
