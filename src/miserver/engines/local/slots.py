"""Slots over a static KV cache and a Llama decode step written over the loaded model's own weights (gpt-fast style).

:class:`SlotModel` is the step loop's cache (the ``steps.Slots`` protocol) for Llama-family models (see
:func:`supported`). Keys and values live in one preallocated tensor per layer, ``[slots, kv_heads, capacity,
head_dim]``; a slot's sequence occupies positions ``0 .. length - 1`` of its row, and a decode step writes one new
column per slot in place (no concatenation, no merging, no padding): each slot attends to its own first ``length + 1``
columns, whatever the lengths of the others (``kv_cache.StaticKVCache``: it grows, doubling, up to ``max_positions``
columns). Under the attention kernel a prompt reuses the columns of the longest prefix it shares with a prompt that
a slot holds (``prefixes.PromptPrefixes``), and only the positions after it are computed.

A prompt is prefilled either by this module's own forward over all its positions (causal attention, the decode
step's weights) or by transformers itself (``generate.prefill``: exactly the one-request prefill), its keys and
values then copied into the slot. The forward is embedding, RMSNorm, rotary embedding, grouped-query attention over
the static cache (in a decode step, the native kernel of ``attention.py`` over each slot's own columns, where it
builds; else torch's fused attention over the longest slot's, masked), SwiGLU MLP, final norm and output head, each
read from the transformers model at every step (weight edits on the resident model are seen at the next step). Its
logits differ from transformers' in the last bits (another attention kernel; with bfloat16 weights or 4-bit products,
in the products' rounding too), so greedy tokens agree with transformers for typical prompts but not bit for bit.
Under the kernel a slot decoded beside others gets the bits of its step alone wherever
:meth:`SlotModel.independent_rows` says so; under torch's attention, within rounding.

Everything here is synchronous and runs under ``torch.inference_mode`` on the engine's thread.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812
from transformers import PreTrainedModel

from miserver.engines.local import attention as attention_kernel
from miserver.engines.local import quantized as quantized_kernel
from miserver.engines.local.generate import prefill
from miserver.engines.local.kv_cache import StaticKVCache
from miserver.engines.local.llama_ops import (
    attention_inputs,
    causal_attention,
    compile_forward,
    ends_of,
    masked_attention,
    project,
    project_all,
    rms_norm,
    rotary_table,
    rows_computed_alone,
    supported,
)
from miserver.engines.local.prefixes import PromptPrefixes
from miserver.engines.local.slot_weights import (
    Layer,
    Matrix,
    WeightCopies,
    WeightLayout,
    bfloat16_available,
    has_quantized,
    packing_available,
)
from miserver.engines.local.steps import StepInterrupted

log = logging.getLogger(__name__)

#: How the decode step attends (see :class:`SlotModel`).
AttentionKind = Literal["kernel", "sdpa"]
#: The dtype of the KV cache (see :class:`SlotModel`).
KVCacheKind = Literal["model", "bfloat16"]


class SlotModel:
    """Slots of sequences over a static KV cache, decoded by this module's Llama forward (see the module).

    ``model`` must satisfy :func:`supported` (else ``ValueError``). ``max_positions`` is the context length: a
    prefill or decode past it raises ``ValueError``. ``weights`` says how the projections and the output head are
    multiplied: ``"view"`` through a transposed view of the model's own weights (no copy); ``"transposed"`` through
    a contiguous ``[in, out]`` copy (faster one-row products with MKL on the CPU); ``"packed"`` through a copy
    prepacked for oneDNN (see :func:`packing_available`; else ``"transposed"`` on the CPU, ``"view"`` elsewhere): on the
    development machine's CPU a step of 2 to 17 rows costs about what one row costs with it, where MKL's small
    matrix products cost three to ten times as much; ``"bfloat16"`` through a bfloat16 copy prepacked for oneDNN
    (where :func:`bfloat16_available`, else ``"packed"``): each product's input is rounded to bfloat16 and its
    output is returned in the model's dtype, while norms, rotary embedding, attention, the residual stream and the
    cache stay in the model's dtype (half the bytes read per token, and the CPU's native bfloat16 dot products).
    bfloat16 is the decode step's only: the own prefill multiplies by the ``"packed"`` copy in the model's dtype, so
    a prompt's first token and its logprobs are those of the model's dtype, as in scoring (quantized bits aside). A
    copy costs one more copy of those weights in memory and is remade at the next step when its parameter changed (a
    weight write). ``compile`` runs the decode forward through ``torch.compile`` (dynamic shapes; compiled at the
    first steps of each new shape, minutes on a small CPU, from inductor's cache at later starts); any failure of it
    is logged and the step runs eager from then on. ``attention`` says how the decode step attends: ``"kernel"``,
    the native kernel of ``attention.py`` (each row over its own columns; built under ``kernel_folder``), where it
    covers the model and builds, and not with ``compile``; else ``"sdpa"``, torch's fused attention over the longest
    row's width, masked. With ``quantized_rows`` above 0 (float32 model on the CPU, eager, a layout other than
    ``"view"``), a decode step of at most that many rows, and the own prefill, multiply each matrix that is exactly
    a GGUF 4-bit (``Q4_1``) or 8-bit (``Q8_0``) one in its own bits (``slot_weights.WeightCopies.matrix``, through
    the kernel of ``quantized.py`` built under ``kernel_folder``): fewer bytes read per token, and integer products,
    each row's inputs rounded to 8 bits a group (as llama.cpp does), so a prompt's first token is then the quantized
    model's. Larger steps multiply in ``weights``. It stays 0 for a model with no such matrix, or without a compiler.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_positions: int,
        weights: WeightLayout = "view",
        own_prefill: bool = False,
        compile: bool = False,
        attention: AttentionKind = "sdpa",
        kv_cache: KVCacheKind = "model",
        kernel_folder: Path | None = None,
        quantized_rows: int = 0,
    ) -> None:
        if not supported(model):
            raise ValueError(f"the slot forward does not cover {type(model).__name__} ({model.config.model_type})")
        if max_positions < 1:
            raise ValueError("max_positions must be positive")
        config = model.config
        self.model = model
        self.max_positions = max_positions
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.layers = len(model.model.layers)
        self.own_prefill = own_prefill
        self._norm = model.model.norm
        self._norm_eps = float(model.model.norm.variance_epsilon)
        #: the compiled forward (``compile``), or None: eager
        self._compiled: Callable[..., torch.Tensor] | None = None
        if compile:
            self._compiled = compile_forward(self._forward)
        device, dtype = model.device, model.dtype
        self.device, self.dtype = device, dtype
        asked = weights
        if weights == "bfloat16" and not (packing_available(device, dtype) and bfloat16_available()):
            weights = "packed"
        if weights == "packed" and not packing_available(device, dtype):
            weights = "transposed" if device.type == "cpu" else "view"
        self.weights: WeightLayout = weights
        own_bits = quantized_rows > 0 and dtype == torch.float32 and not compile and weights != "view"
        own_bits = own_bits and device.type == "cpu" and has_quantized(model)
        products = quantized_kernel.load(kernel_folder) if own_bits else None
        #: the weights in each layout (see ``slot_weights``), with the quantized product kernel where it was loaded
        self._copies = WeightCopies(model, products)
        #: the prefill and steps of at most this many rows multiply quantized matrices in their own bits (0: never)
        self.quantized_rows = quantized_rows if products is not None else 0
        #: the native decode attention, or None: torch's
        self._kernel: attention_kernel.DecodeAttention | None = None
        covered = attention_kernel.DecodeAttention.covers(self.heads, self.kv_heads, self.head_dim, dtype, device)
        if attention == "kernel" and covered and not compile:
            self._kernel = attention_kernel.load(kernel_folder)
        self.attention: AttentionKind = "kernel" if self._kernel is not None else "sdpa"
        self.kv_cache: KVCacheKind = kv_cache if self._kernel is not None else "model"
        self.kv_dtype = torch.bfloat16 if self.kv_cache == "bfloat16" else dtype
        log.info(
            "slot forward: decode step weights %s%s%s, attention %s, KV cache %s",
            weights,
            f" ({asked} is not available here)" * (asked != weights),
            f", quantized matrices in their own bits in steps of up to {self.quantized_rows} rows"
            * (self.quantized_rows > 0),
            self.attention,
            self.kv_dtype,
        )
        #: the own prefill's layout: the decode step's, in the model's dtype (bfloat16 decodes only)
        self.prefill_weights: WeightLayout = "packed" if weights == "bfloat16" else weights
        self._cos, self._sin = rotary_table(model.model.rotary_emb, max_positions, device, dtype)
        self._lengths: dict[int, int] = {}
        #: the prompts whose keys and values the slots hold, reused by later prompts (under the attention kernel)
        self.prefixes = PromptPrefixes()
        #: row count -> whether a decode step of that many rows gives each row its bits alone (checked once)
        self._independent: dict[int, bool] = {}
        #: the row-wise operations' outputs of each check row alone (see :func:`rows_computed_alone`)
        self._alone_rows: list[tuple[torch.Tensor, ...]] = []
        self._kv = StaticKVCache(self.layers, self.kv_heads, self.head_dim, self.kv_dtype, device, max_positions)

    # --- the Slots protocol -----------------------------------------------------------------------------------------

    def length(self, slot: int) -> int:
        """Tokens in ``slot``'s cache. Raises ``KeyError`` for a slot that holds nothing."""
        return self._lengths[slot]

    def prefill(self, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``ids`` (``[prompt_len]``, long, ``prompt_len >= 1``) into ``slot`` (its old content is
        dropped); returns the float32 logits ``[vocab]`` of the last position: with ``own_prefill``, this module's
        forward over every position of the prompt (causal attention, the same projections as the decode step);
        else transformers' own prefill, bit for bit. Raises ``ValueError`` for an empty prompt or one longer than
        ``max_positions``."""
        n = self._check_prompt(ids)
        if self.own_prefill:
            return self._prefill_into([slot], [ids])[0]
        self.release(slot)
        self.prefixes.forget(slot)
        logits, cache = prefill(self.model, ids)
        self._kv.reserve(slot, n)
        for i, layer in enumerate(getattr(cache, "layers", [])):
            keys, values = layer.keys, layer.values
            assert keys is not None and values is not None  # [1, kv_heads, n, head_dim]
            self._kv.keys[i][slot, :, :n].copy_(keys[0])
            self._kv.values[i][slot, :, :n].copy_(values[0])
        self._lengths[slot] = n
        return logits

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run ``prompts[i]`` into ``slots[i]`` as :meth:`prefill` does; the float32 logits ``[vocab]`` of each
        prompt's last position. With ``own_prefill`` over prepacked weights the prompts go through one forward pass:
        their positions are the rows of each product (oneDNN's product of a prepacked weight computes a row's bits
        whatever the other rows), attention runs per prompt, rotary embedding and norms per row, so each slot's cache
        and logits are bit for bit its prefill alone's, and the weights are read once (twice where prompts that
        share a long prefix no slot holds wait for a second pass that copies it: ``PromptPrefixes.passes``);
        otherwise one prompt after the other. Raises ``ValueError`` as :meth:`prefill` does, before any slot
        changes."""
        for ids in prompts:
            self._check_prompt(ids)
        if self.own_prefill and (len(prompts) == 1 or self.prefill_weights == "packed"):
            if self._kernel is None or len(prompts) == 1:  # no prompt is reused without the kernel
                return self._prefill_into(list(slots), list(prompts))
            logits: dict[int, torch.Tensor] = {}
            for part in self.prefixes.passes(slots, prompts):
                done = self._prefill_into([slots[i] for i in part], [prompts[i] for i in part])
                logits.update(zip(part, done, strict=True))
            return [logits[i] for i in range(len(prompts))]
        return [self.prefill(slot, ids) for slot, ids in zip(slots, prompts, strict=True)]

    def _prefill_into(self, slots: list[int], prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`_prefill` of checked ``prompts`` into ``slots`` (their old content dropped, room reserved)."""
        for slot, ids in zip(slots, prompts, strict=True):
            self.release(slot)
            self._kv.reserve(slot, int(ids.numel()))
        logits = self._prefill(prompts, slots)
        for slot, ids in zip(slots, prompts, strict=True):
            self._lengths[slot] = int(ids.numel())
        return logits

    def fork(self, src: int, dst: int) -> None:
        """``dst`` gets a copy of ``src``'s cache (the other samples of one prompt)."""
        n = self._lengths[src]
        self._kv.reserve(dst, n)
        self._kv.copy(src, dst, n)
        self._lengths[dst] = n
        self.prefixes.copy(src, dst, n)

    def forget_prompts(self) -> None:
        """Stop reusing the prompts the slots hold (the weights may have been written)."""
        self.prefixes.forget()

    def _check_prompt(self, ids: torch.Tensor) -> int:
        """The length of the prompt ``ids``; ``ValueError`` when it is empty or longer than the context."""
        n = int(ids.numel())
        if n == 0:
            raise ValueError("the prompt has no tokens")
        if n > self.max_positions:
            raise ValueError(f"the prompt has {n} tokens; the context holds {self.max_positions}")
        return n

    def independent_rows(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` slots gives each slot the bits of its step alone. It does under the
        attention kernel (each row reads its own columns, in an order that never depends on the others) when every
        row-wise operation of the forward does too: each product with the step's weights (the kernels a library
        picks may depend on the row count), RMSNorm, rotary embedding, SwiGLU and the residual adds. Those are
        checked once per row count on this machine (:func:`llama_ops.rows_computed_alone`, random rows through one
        layer's operations and the output head); False under torch's attention."""
        if self._kernel is None:
            return False
        if rows not in self._independent:
            like = self._norm.weight  # [hidden], the model's dtype and device
            self._independent[rows] = rows_computed_alone(self._row_ops, rows, self._alone_rows, like)
            if not self._independent[rows]:
                log.warning("a %d-row decode step changes a row's bits here: batch-invariant rows decode alone", rows)
        return self._independent[rows]

    def _row_ops(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The decode forward's row-wise operations on ``x`` (``[rows, hidden]``) at ``positions`` (``[rows]``),
        with layer 0's weights and the output head in the decode step's layout: one layer without attention (whose
        input stands in for the attention's output), then the final norm and the logits."""
        b = x.shape[0]
        quantized = b <= self.quantized_rows
        layer = self._copies.layers(self.weights, quantized=quantized)[0]
        head = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
        cos, sin = self._cos[positions], self._sin[positions]
        q, k, v = attention_inputs(x, layer, cos, sin, self.eps, self.heads, self.kv_heads)
        v = v.to(self.kv_dtype)
        hidden = x + project(q.reshape(b, -1), layer.o, layer.o_bias)
        gate, up = project_all(rms_norm(hidden, layer.norm_post, self.eps), layer.gate_up)
        hidden = hidden + project(F.silu(gate) * up, layer.down, None)
        last = rms_norm(hidden, self._norm.weight, self._norm_eps)
        logits = project(last, self._copies.matrix(head.weight, self.weights, quantized=quantized), head.bias).float()
        return k.to(self.kv_dtype), v, logits

    def release(self, slot: int) -> None:
        """Forget ``slot``'s cache (nothing happens for an empty slot)."""
        self._lengths.pop(slot, None)

    def decode(
        self, slots: Sequence[int], tokens: Sequence[int], stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Feed ``tokens[i]`` after ``slots[i]``'s cache, every slot at its own next position, in one forward pass;
        returns float32 logits ``[len(slots), vocab]`` and each slot grows by one token. Raises ``ValueError`` for a
        slot already holding ``max_positions`` tokens, ``KeyError`` for an empty one, and ``StepInterrupted`` when
        ``stop()`` is true before a layer of the eager forward (no slot grows; the columns written are written again,
        with the same values, when the token is fed again)."""
        lengths = [self._lengths[s] for s in slots]
        for slot, n in zip(slots, lengths, strict=True):
            if n >= self.max_positions:
                raise ValueError(f"slot {slot} is full: the context holds {self.max_positions} tokens")
            self._kv.reserve(slot, n + 1)
        logits = self._step(list(slots), list(tokens), lengths, stop)
        for slot, n in zip(slots, lengths, strict=True):
            self._lengths[slot] = n + 1
        return logits

    # --- the forward ------------------------------------------------------------------------------------------------

    def _step(
        self, slots: list[int], tokens: list[int], lengths: list[int], stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """One decode step (see :meth:`decode`): ``[rows, vocab]`` float32 logits. Runs the compiled forward when
        there is one; a compiled forward that fails is dropped (logged) and the step runs eager (the cache columns it
        may have written are written again, with the same values)."""
        device = self.device
        lo, hi = min(slots), max(slots)
        rows = hi - lo + 1  # attention runs over the slot range lo..hi (the slots in it not decoded are ignored)
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        pos_t = torch.tensor(lengths, dtype=torch.long, device=device)
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)
        # columns each row of the range attends to: its own length + 1 (one column for rows not decoded)
        seen = torch.ones(rows, dtype=torch.long, device=device)
        seen[slot_t - lo] = pos_t + 1
        head = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
        quantized = len(slots) <= self.quantized_rows
        layers = self._copies.layers(self.weights, quantized=quantized)
        matrix = self._copies.matrix(head.weight, self.weights, quantized=quantized)
        args = (tokens_t, slot_t, pos_t, seen, lo, max(lengths) + 1, layers, matrix)
        if self._compiled is not None:
            try:
                return self._compiled(*args, head.bias)
            except Exception:
                log.warning("the compiled decode step failed; decoding eager from now on", exc_info=True)
                self._compiled = None
        return self._forward(*args, head.bias, stop)

    def _forward(
        self,
        tokens: torch.Tensor,
        slot_t: torch.Tensor,
        pos_t: torch.Tensor,
        seen: torch.Tensor,
        lo: int,
        width: int,
        layers: list[Layer],
        head: Matrix,
        head_bias: torch.Tensor | None,
        stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """The decode forward of ``tokens`` (``[B]``) into the slots ``slot_t`` at positions ``pos_t`` (``[B]``),
        attending over the slot range ``lo .. lo + len(seen) - 1``, row ``r`` to its first ``seen[r]`` columns, at
        most ``width``; ``head`` is the ``[hidden, vocab]`` output matrix. Returns float32 logits ``[B, vocab]``;
        raises ``StepInterrupted`` when ``stop()`` is true before a layer."""
        row_t = slot_t - lo
        hidden = self._embed(tokens)  # [B, hidden]
        cos, sin = self._cos[pos_t], self._sin[pos_t]  # [B, 1, head_dim]
        kernel = self._kernel
        columns = pos_t + 1  # [B]: each row's own columns (the kernel's)
        mask = torch.arange(width, device=tokens.device)[None, :] >= seen[:, None]  # [rows, width]: True is hidden
        for i, layer in enumerate(layers):
            if stop is not None and stop():
                raise StepInterrupted(f"the decode step was given up before layer {i}")
            q, k, v = attention_inputs(hidden, layer, cos, sin, self.eps, self.heads, self.kv_heads)
            if kernel is not None:  # the kernel writes the step's keys and values into the cache first
                attn = kernel(q, self._kv.keys[i], self._kv.values[i], slot_t, columns, self.scale, k, v)
            else:
                self._kv.keys[i][slot_t, :, pos_t] = k.to(self.kv_dtype)
                self._kv.values[i][slot_t, :, pos_t] = v.to(self.kv_dtype)
                keys = self._kv.keys[i][lo : lo + seen.shape[0], :, :width]  # [rows, kv_heads, width, head_dim], a view
                values = self._kv.values[i][lo : lo + seen.shape[0], :, :width]
                attn = masked_attention(q, keys, values, row_t, mask, self.scale)  # [B, heads * head_dim]
            hidden = hidden + project(attn, layer.o, layer.o_bias)
            gate, up = project_all(rms_norm(hidden, layer.norm_post, self.eps), layer.gate_up)
            hidden = hidden + project(F.silu(gate) * up, layer.down, None)
        hidden = rms_norm(hidden, self._norm.weight, self._norm_eps)
        return project(hidden, head, head_bias).float()

    def _prefill(self, prompts: list[torch.Tensor], slots: list[int]) -> list[torch.Tensor]:
        """The forward of ``prompts`` (each ``[n_i]``, at positions ``0 .. n_i - 1``) as the rows of one pass, each
        prompt attending causally to itself only, writing each layer's keys and values into its slot's first ``n_i``
        columns; float32 logits ``[vocab]`` of each prompt's last position (the output head runs on those only).

        Under the attention kernel every position attends through it over its slot's cache columns, row by row, and a
        prompt first takes the longest prefix that a slot's earlier prompt shares with it (``prefixes``; another
        slot's columns are copied, its own slot's kept): only the positions after it are computed, with the same
        bits as when they all are."""
        quantized = self.quantized_rows > 0  # the prefill's products are row by row: any length
        layers = self._copies.layers(self.prefill_weights, quantized=quantized)
        kernel, starts = self._kernel, [0] * len(prompts)
        if kernel is not None:
            self.prefixes.check_weights(layers, self._table())
            for j, (slot, ids) in enumerate(zip(slots, prompts, strict=True)):
                donor, starts[j] = self.prefixes.longest(ids, exclude=set(slots) - {slot})
                if donor != slot and starts[j]:
                    self._kv.copy(donor, slot, starts[j])
        for slot in slots:
            self.prefixes.forget(slot)
        lengths = [int(ids.shape[0]) - s for ids, s in zip(prompts, starts, strict=True)]
        ids = torch.cat([p[s:] for p, s in zip(prompts, starts, strict=True)])  # [N]
        device = ids.device
        positions = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lengths, strict=True)])
        row_slots = torch.tensor(slots, device=device).repeat_interleave(torch.tensor(lengths, device=device))
        hidden = self._embed(ids)  # [N, hidden]
        cos, sin = self._cos[positions], self._sin[positions]
        seen = positions + 1  # [N]: the columns each row attends to, its own the last
        for i, layer in enumerate(layers):
            q, k, v = attention_inputs(hidden, layer, cos, sin, self.eps, self.heads, self.kv_heads)
            if kernel is not None:
                attn = kernel(q, self._kv.keys[i], self._kv.values[i], row_slots, seen, self.scale, k, v)
            else:
                attn = causal_attention(q, k, v, lengths)
                for (slot, n), at in zip(zip(slots, lengths, strict=True), ends_of(lengths), strict=True):
                    self._kv.keys[i][slot, :, :n] = k[at - n : at].transpose(0, 1)  # [kv_heads, n, head_dim]
                    self._kv.values[i][slot, :, :n] = v[at - n : at].transpose(0, 1)
            hidden = hidden + project(attn, layer.o, layer.o_bias)
            gate, up = project_all(rms_norm(hidden, layer.norm_post, self.eps), layer.gate_up)
            hidden = hidden + project(F.silu(gate) * up, layer.down, None)
        if kernel is not None:
            for slot, p, s in zip(slots, prompts, starts, strict=True):
                self.prefixes.record(slot, p, s)
        ends = torch.tensor(lengths, device=device).cumsum(0) - 1
        last = rms_norm(hidden[ends], self._norm.weight, self._norm_eps)
        head = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
        matrix = self._copies.matrix(head.weight, self.prefill_weights, quantized=quantized)
        return list(project(last, matrix, head.bias).float())

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self._table())

    def _table(self) -> torch.Tensor:
        table = self.model.get_input_embeddings().weight
        assert isinstance(table, torch.Tensor)
        return table
