"""Scoring requests answered as prefill-only sequences of the step loop (DESIGN §3.4, scoring mode).

A scoring request's one token is the first token a generation request with the same prompt and parameters samples:
so it is computed there, as a sequence that the step loop admits, prefills and retires at once, beside whatever else
runs (an interactive one is admitted at the next step, a batch one takes a batch slot). The step loop's prefill gives
each prompt the bits of its prefill alone whatever starts with it, so a scoring request alone, a batch's
``pack: false`` row and a row of a packed pack all get one answer, and that answer is the first token of the same
request generated with a larger ``max_tokens``.

Only what the step loop does not compute runs as a scoring pass over the whole prompt (``score.score_pack``):
prompt logprobs (``echo``), asked for at ``max_tokens`` 0 (no token follows), or beside the one token, whose pass
then contributes the prompt logprobs only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from miserver.engines.base import Generated, GenerationRequest, ScoreRequest, ScoreResult

#: Runs generation requests as one group of the step loop (``LocalEngine.generate_many`` with its slots bound).
Steps = Callable[[Sequence[GenerationRequest]], AsyncIterator[Generated]]
#: Runs scoring requests as one scoring pass on the engine thread (``score.score_pack``).
Passes = Callable[[Sequence[ScoreRequest]], Awaitable[list[ScoreResult]]]


def check(requests: Sequence[ScoreRequest]) -> None:
    """Raise ``ValueError`` for a request the scoring mode refuses: ``max_tokens`` above 1, or an empty prompt that
    needs a forward pass (a token to choose, or prompt logprobs)."""
    for r in requests:
        if r.generation.params.max_tokens > 1:
            raise ValueError("a scoring request has max_tokens 0 or 1")
    if any(not r.prompt_ids and (r.generation.params.max_tokens or r.prompt_logprobs is not None) for r in requests):
        raise ValueError("the prompt has no tokens")


async def score_requests(
    requests: Sequence[ScoreRequest],
    steps: Steps,
    passes: Passes,
    count: Callable[[GenerationRequest], None] = lambda _: None,
) -> list[ScoreResult]:
    """``requests`` answered in order: each one token by ``steps`` (one group), prompt logprobs and ``max_tokens`` 0
    by one call of ``passes``. ``count`` is called, once they are checked, with each request that runs in the pass
    only (the step loop counts the others as it starts them). Raises ``ValueError`` as :func:`check`, or the first
    refusal of the step loop (a prompt longer than the context), after which no further request of the group
    starts."""
    check(requests)
    stepped = [i for i, r in enumerate(requests) if r.generation.params.max_tokens == 1]
    passed = [i for i, r in enumerate(requests) if r.prompt_logprobs is not None or r.generation.params.max_tokens == 0]
    for r in requests:
        if r.generation.params.max_tokens == 0:
            count(r.generation)
    results: dict[int, ScoreResult] = {}
    if passed:
        prompt_only = [_without_token(requests[i]) for i in passed]
        results = dict(zip(passed, await passes(prompt_only), strict=True))
    if stepped:
        async for done in steps([requests[i].generation for i in stepped]):
            if isinstance(done.result, ValueError):
                raise done.result
            i = stepped[done.index]
            prompt = results.get(i)  # its pass's prompt logprobs, when it asked for them
            results[i] = ScoreResult(done.result) if prompt is None else replace(prompt, generation=done.result)
    return [results[i] for i in range(len(requests))]


def _without_token(request: ScoreRequest) -> ScoreRequest:
    """``request`` at ``max_tokens`` 0: its scoring pass computes the prompt logprobs and chooses no token."""
    gen = request.generation
    if gen.params.max_tokens == 0:
        return request
    return replace(request, generation=replace(gen, params=replace(gen.params, max_tokens=0)))
