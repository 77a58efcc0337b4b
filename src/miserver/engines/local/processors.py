"""Per-sequence logits processors of the resident engine: logit bias, OpenAI's penalties, and grammars.

Each sequence in flight carries its own :class:`Processors` (its bias, the counts of the tokens it has sampled, and
its grammar matcher), so rows with different parameters share one decode step. :func:`process` turns a
sequence's raw logits (float32 ``[vocab]``) into the logits it samples from; :meth:`Processors.accept` records the
token it sampled. Grammars are compiled by xgrammar (the constrained-decoding library vLLM and SGLang use) into a
token bitmask per step; :class:`Grammars` compiles each distinct grammar once and keeps it (a batch of 50,000 rows
with one schema compiles it once).

Everything here runs on the engine's thread (compilation may also run on the caller's thread: it is guarded).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from miserver.engines.base import Grammar, SamplingParams

#: The provenance name of the grammar library (``X-miLLM-Grammar``).
BACKEND = "xgrammar"
#: Compiled grammars kept (least recently used first out).
CACHE_SIZE = 256

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed internal check
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgr() -> Any:
    """The xgrammar module (imported on first use: a server that never constrains never loads it). Raises
    ``NotImplementedError`` where it is not installed."""
    try:
        import xgrammar
    except ImportError as exc:
        raise NotImplementedError("constrained decoding needs the xgrammar package, which is not installed") from exc
    return xgrammar


@dataclass
class CacheStats:
    """Grammar compilations asked for: ``hits`` found compiled, ``misses`` compiled (each miss costs a compile)."""

    hits: int = 0
    misses: int = 0


class Grammars:
    """The compiled grammars of one model (its tokenizer, ``vocab_size`` logits, and ``stop_ids`` as the tokens that
    end a complete text), most recently used kept, :data:`CACHE_SIZE` at most."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: Collection[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(stop_ids)
        self.stats = CacheStats()
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> Any:
        """The compiled ``grammar`` (an ``xgrammar.CompiledGrammar``), from the cache or compiled now.

        JSON has fixed separators (``", "`` and ``": "``; no free whitespace, which a small model would otherwise
        spend its tokens on) and objects admit only the properties the schema names (xgrammar's strict mode, as
        vLLM uses it).
        Raises ``ValueError`` with xgrammar's reason when the schema cannot be compiled, ``NotImplementedError``
        where xgrammar is not installed."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                self.stats.hits += 1
                return self._compiled[grammar]
            self.stats.misses += 1
            xgr = _xgr()
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.stop_ids)
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            schema = grammar.schema if grammar.kind == "json_schema" else '{"type": "object"}'
            try:
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            except (RuntimeError, TypeError, ValueError) as exc:
                raise ValueError(_NOISE.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")) from exc
            self._compiled[grammar] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled


@dataclass
class Processors:
    """One sequence's processors: bias ids and values (tensors ``[k]``), its penalties and sampled-token counts, and
    its grammar matcher and bitmask (``xgrammar``; None without a grammar)."""

    params: SamplingParams
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    counts: dict[int, int] = field(default_factory=dict)
    matcher: Any = None
    bitmask: Any = None

    def accept(self, token: int) -> None:
        """Record the sampled ``token``: count it, and advance the grammar (a token the mask allowed is always
        accepted; an end-of-sequence token the grammar did not allow raises ``ValueError``)."""
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.matcher is not None and not self.matcher.accept_token(token):
            raise ValueError(f"token {token} leaves the grammar")


def processors_for(params: SamplingParams, grammars: Grammars | None, device: torch.device) -> Processors | None:
    """The processors of one sequence sampled with ``params`` (None when it has none). Raises ``ValueError`` when
    ``params.grammar`` is set and ``grammars`` is None (a model without a tokenizer for grammars) or it cannot be
    compiled."""
    if not params.processed:
        return None
    proc = Processors(params)
    if params.logit_bias:
        proc.bias_ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=device)
        proc.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
    if params.grammar is not None:
        if grammars is None:
            raise ValueError("this model cannot apply a grammar")
        xgr = _xgr()
        proc.matcher = xgr.GrammarMatcher(grammars.compile(params.grammar))
        proc.bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    return proc


def process(logits: torch.Tensor, proc: Processors | None) -> torch.Tensor:
    """The logits (float32 ``[vocab]``) a sequence samples from: ``logits`` itself without processors, else a copy
    with the bias added, the penalties subtracted and the grammar's disallowed tokens at ``-inf``."""
    if proc is None:
        return logits
    out = logits.clone()
    if proc.bias_ids is not None and proc.bias_values is not None:
        out.index_add_(0, proc.bias_ids, proc.bias_values)
    params = proc.params
    if proc.counts and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor(list(proc.counts), dtype=torch.long, device=out.device)
        counts = torch.tensor(list(proc.counts.values()), dtype=torch.float32, device=out.device)
        out.index_add_(0, ids, -(counts * params.frequency_penalty + params.presence_penalty))
    if proc.matcher is not None:
        xgr = _xgr()
        proc.matcher.fill_next_token_bitmask(proc.bitmask)
        xgr.apply_token_bitmask_inplace(out, proc.bitmask)
    return out
