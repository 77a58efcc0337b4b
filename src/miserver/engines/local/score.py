"""Scoring-mode forward passes, alone or as one right-padded pack (DESIGN §3.4 "Scoring mode", §4 "Packing").

A pack is ``[rows, width]`` token ids, each row right-padded to the longest one. Under the causal mask a real token
attends only to positions before it, which are all real, so no padding mask is needed: each row's real positions
compute what the row alone computes, up to the rounding of a wider matrix product. Each row is read at its own last
real token, and the LM head runs only at the positions read (the last one, plus every prompt position of a row that
asks for prompt logprobs). A prefix common to every row of a pack runs once. A request alone is a pack of one row,
without padding.

Everything here is synchronous and runs under ``torch.inference_mode`` on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from miserver.engines.base import ScoreRequest, ScoreResult, TokenLogprob
from miserver.engines.local.detokenize import TokenTexts, text_pieces, token_texts
from miserver.engines.local.generate import cache_kwarg, collect_result, generate_sequence
from miserver.engines.local.processors import Grammars

#: Prompt positions whose logits are materialised at once for prompt logprobs (bounds memory: chunk x vocab floats).
PROMPT_CHUNK = 256
#: A pack whose rows share at least this many leading tokens computes them once (see :func:`pack_hidden`).
MIN_SHARED_PREFIX = 16


def padded_ids(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """``rows`` (each at least one id) right-padded with ``pad_id`` into a ``[len(rows), longest]`` long tensor."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(list(row), dtype=torch.long)
    return ids.to(device)


def shared_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the token prefix common to every row, kept at least one token short of the shortest row
    (0 for fewer than two rows)."""
    if len(rows) < 2:
        return 0
    first, limit = rows[0], min(len(r) for r in rows) - 1
    k = 0
    while k < limit and all(r[k] == first[k] for r in rows):
        k += 1
    return k


def pack_hidden(model: PreTrainedModel, rows: Sequence[Sequence[int]], pad_id: int, layer: int = -1) -> torch.Tensor:
    """Hidden states ``[len(rows), longest, hidden]`` of a right-padded pack at ``layer``.

    ``layer`` -1 is the decoder's final, normed output (what the LM head reads); otherwise it indexes
    transformers' ``hidden_states`` (0 = token embeddings). Positions past a row's length are padding: ignore them.
    When the rows share a prefix of at least :data:`MIN_SHARED_PREFIX` tokens (the same instruction before every
    row, typically) the prefix runs once and its key/value cache is shared by the rows' remaining tokens: the same
    attention, without computing the prefix once per row.
    """
    want_all = layer != -1
    base = model.base_model
    common = shared_prefix(rows)
    if common < MIN_SHARED_PREFIX:
        out = base(input_ids=padded_ids(rows, pad_id, model.device), use_cache=False, output_hidden_states=want_all)
        hidden: torch.Tensor = out.hidden_states[layer] if want_all else out.last_hidden_state
        return hidden
    cache = DynamicCache(config=model.config)
    kwarg = cache_kwarg(type(base))
    prefix_ids = torch.tensor([list(rows[0][:common])], dtype=torch.long, device=model.device)
    head = base(input_ids=prefix_ids, use_cache=True, output_hidden_states=want_all, **{kwarg: cache})
    cache.batch_repeat_interleave(len(rows))
    rest = padded_ids([r[common:] for r in rows], pad_id, model.device)
    tail = base(input_ids=rest, use_cache=True, output_hidden_states=want_all, **{kwarg: cache})
    first = head.hidden_states[layer] if want_all else head.last_hidden_state  # [1, common, hidden]
    second = tail.hidden_states[layer] if want_all else tail.last_hidden_state  # [rows, longest - common, hidden]
    return torch.cat([first.expand(len(rows), -1, -1), second], dim=1)


def score_pack(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[ScoreRequest],
    *,
    pad_id: int,
    eos_ids: Collection[int] = (),
    max_positions: int | None = None,
    grammars: Grammars | None = None,
) -> list[ScoreResult]:
    """Answer ``requests`` with one forward pass over all of them (one right-padded pack); results in order.

    A request with ``max_tokens`` 0 and no prompt logprobs needs no forward pass and takes no place in the pack.
    Raises ``ValueError`` for ``max_tokens`` above 1 or an empty prompt that needs a forward pass.
    """
    for r in requests:
        if r.generation.params.max_tokens > 1:
            raise ValueError("a scoring request has max_tokens 0 or 1")
    needs = [i for i, r in enumerate(requests) if _needs_forward(r)]
    if any(not requests[i].prompt_ids for i in needs):
        raise ValueError("the prompt has no tokens")
    logits: dict[int, torch.Tensor] = {}
    prompt: dict[int, list[TokenLogprob | None]] = {}
    texts = token_texts(tokenizer)
    if needs:
        rows = [requests[i].prompt_ids for i in needs]
        hidden = pack_hidden(model, rows, pad_id)
        head = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
        last = torch.tensor([len(r) - 1 for r in rows], device=hidden.device)
        read = head(hidden[torch.arange(len(rows), device=hidden.device), last]).float()  # [rows, vocab]
        for b, i in enumerate(needs):
            logits[i] = read[b]
            k = requests[i].prompt_logprobs
            if k is not None:
                prompt[i] = prompt_logprobs(head, hidden[b, : len(rows[b])], rows[b], k, texts)
    empty_cache = DynamicCache(config=model.config)  # never read: one token at most follows the prompt
    results = []
    for i, r in enumerate(requests):
        gen = r.generation
        deltas = (
            delta
            for s in range(gen.n)
            for delta in generate_sequence(
                model,
                tokenizer,
                gen.prompt_ids,
                gen.params,
                index=s,
                seed=gen.params.seed + s,
                eos_ids=eos_ids,
                max_positions=max_positions,
                grammars=grammars,
                prefilled=(logits[i], empty_cache) if i in logits else None,
            )
        )
        result = collect_result(deltas, gen)
        if r.prompt_logprobs is None:
            results.append(ScoreResult(result))
        else:
            pieces = text_pieces(tokenizer, r.prompt_ids)
            lps = prompt.get(i, [None] * len(r.prompt_ids))
            with_pieces = [None if lp is None else replace(lp, text=piece) for lp, piece in zip(lps, pieces)]
            results.append(ScoreResult(result, with_pieces, pieces))
    return results


def prompt_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    ids: Sequence[int],
    k: int,
    texts: TokenTexts,
) -> list[TokenLogprob | None]:
    """Each prompt token's logprob given the tokens before it, with the ``k`` most likely alternatives.

    ``hidden`` is ``[len(ids), hidden]`` (one row of a pack, padding cut off). The first token has nothing before
    it: its entry is None (OpenAI's ``echo`` shape). Logits are made ``PROMPT_CHUNK`` positions at a time. Tokens
    are rendered by ``texts``; ``token_bytes`` is each token's share of the prompt's text (nothing for a special
    token); ``text`` is left None (the caller knows the pieces, :func:`~.generate.text_pieces`).
    """
    out: list[TokenLogprob | None] = [None]
    targets = torch.tensor(list(ids[1:]), dtype=torch.long, device=hidden.device)
    for start in range(0, len(ids) - 1, PROMPT_CHUNK):
        stop = min(start + PROMPT_CHUNK, len(ids) - 1)
        logp = torch.log_softmax(head(hidden[start:stop]).float(), dim=-1)  # position p predicts ids[p + 1]
        chosen = logp.gather(1, targets[start:stop, None])[:, 0].tolist()
        top_v, top_i = torch.topk(logp, k, dim=-1) if k > 0 else (None, None)
        for j, value in enumerate(chosen):
            token = int(ids[start + j + 1])
            top: tuple[tuple[int, str, float], ...] = ()
            if top_v is not None and top_i is not None:
                pairs = zip(top_v[j].tolist(), top_i[j].tolist())
                top = tuple((int(t), texts.token(int(t)), float(v)) for v, t in pairs)
            top_bytes = tuple(texts.raw(t) for t, _, _ in top)
            out.append(TokenLogprob(token, texts.token(token), float(value), top, texts.returned(token), top_bytes))
    return out


def _needs_forward(request: ScoreRequest) -> bool:
    return request.generation.params.max_tokens > 0 or request.prompt_logprobs is not None
