"""Conversion of validated request fields into engine sampling parameters (never done on a request model).

Defaults follow the OpenAI API: ``temperature`` 1, ``top_p`` 1, ``n`` 1.
"""

from __future__ import annotations

from ..scheduling.admission import Priority
from .base import GenerationRequest, Grammar, SamplingParams


def normalise_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (OpenAI accepts a string or up to 4 strings)."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    return tuple(s for s in items if s)


def generation_request(
    prompt_ids: list[int],
    *,
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    stop: str | list[str] | None,
    seed: int,
    logprobs: int | None,
    n: int | None,
    logit_bias: tuple[tuple[int, float], ...] = (),
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    grammar: Grammar | None = None,
    priority: Priority = Priority.INTERACTIVE,
    fairness_key: str = "",
    invariant: bool = False,
) -> GenerationRequest:
    """A :class:`GenerationRequest` for ``prompt_ids`` (shape ``[prompt_len]``) with OpenAI defaults applied; the
    last three say how a step-scheduling engine admits it (see :class:`GenerationRequest`)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        stop=normalise_stop(stop),
        seed=seed,
        logprobs=logprobs,
        logit_bias=logit_bias,
        frequency_penalty=float(frequency_penalty or 0.0),
        presence_penalty=float(presence_penalty or 0.0),
        grammar=grammar,
    )
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        params=params,
        n=n or 1,
        priority=priority,
        fairness_key=fairness_key,
        invariant=invariant,
    )
