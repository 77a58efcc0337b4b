"""The Llama operations of the slot forward (``slots.SlotModel``): a projection over a plain, transposed or
prepacked weight, RMSNorm, rotary embedding, and ``torch.compile`` of a forward with its fallback; and
:func:`supported`, the models they compute. Each works row by row (a row's result never depends on the other rows of
its tensor, given the same kernel)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from transformers import PreTrainedModel

from miserver.engines.local.slot_weights import Int4Matrix, Int8Matrix, Layer, Matrix, Projections

log = logging.getLogger(__name__)


def compile_forward(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | None:
    """``torch.compile(forward)`` with dynamic shapes, or None (logged) when compiling cannot even start."""
    try:
        compiled: Callable[..., torch.Tensor] = torch.compile(forward, dynamic=True)
    except Exception:
        log.warning("torch.compile is unavailable; the decode step runs eager", exc_info=True)
        return None
    return compiled


def project(x: torch.Tensor, matrix: Matrix, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ matrix`` (``[rows, in] @ [in, out]``), plus ``bias`` (``[out]``) when there is one; a oneDNN
    ``matrix`` is the ``[out, in]`` weight prepacked (``slot_weights.WeightCopies.matrix``), multiplied by oneDNN's
    linear; a 4-bit or 8-bit one (``slot_weights.Int4Matrix``, ``Int8Matrix``; float32 ``x``) by the quantized
    product kernel (``quantized.py``)."""
    if isinstance(matrix, Int4Matrix | Int8Matrix):
        if isinstance(matrix, Int4Matrix):
            own = matrix.product.int4(x, matrix.tiles)
        else:
            own = matrix.product.int8(x, matrix.tiles)
        return own if bias is None else own + bias
    if matrix.is_mkldnn:
        if matrix.dtype == x.dtype:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, matrix, bias, "none", [], "")
            return y
        # bfloat16 weights: the product in bfloat16, its result back in x's dtype
        low: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.to(matrix.dtype), matrix, None, "none", [], "")
        y = low.to(x.dtype)
        return y if bias is None else y + bias
    y = torch.matmul(x, matrix)
    return y if bias is None else y + bias


def project_all(x: torch.Tensor, group: Projections) -> list[torch.Tensor]:
    """Each projection of ``group`` applied to ``x`` (``[rows, in]``): ``[rows, size]`` per projection, in order; a
    fused group is one product, split along its outputs (views)."""
    if len(group.matrices) == 1:
        return list(project(x, group.matrices[0], group.biases[0]).split_with_sizes(list(group.sizes), -1))
    return [project(x, m, b) for m, b in zip(group.matrices, group.biases, strict=True)]


def attention_inputs(
    hidden: torch.Tensor,
    layer: Layer,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries and keys, rotated, and the values of ``hidden`` (``[rows, hidden]``) through ``layer``'s input
    RMSNorm (``eps``) and query-key-value projections, at the positions of ``cos`` and ``sin`` (``[rows, 1,
    head_dim]``, see :func:`rotary_table`): ``[rows, heads, head_dim]``, ``[rows, kv_heads, head_dim]`` twice. From
    one fused product, the queries and keys (neighbours in its output) are rotated as one tensor."""
    rows, dim = hidden.shape[0], cos.shape[-1]
    x = rms_norm(hidden, layer.norm_in, eps)
    if len(layer.qkv.matrices) == 1:
        y = project(x, layer.qkv.matrices[0], layer.qkv.biases[0])  # [rows, (heads + 2 kv_heads) * dim]
        qk, v = y.view(rows, heads + 2 * kv_heads, dim).split_with_sizes([heads + kv_heads, kv_heads], 1)
        q, k = rotate(qk, cos, sin).split_with_sizes([heads, kv_heads], 1)
        return q, k, v
    q, k, v = project_all(x, layer.qkv)
    q = rotate(q.reshape(rows, heads, dim), cos, sin)
    k = rotate(k.reshape(rows, kv_heads, dim), cos, sin)
    return q, k, v.reshape(rows, kv_heads, dim)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Causal attention of each prompt (``lengths[j]`` consecutive rows of ``q`` ``[N, heads, head_dim]``, ``k`` and
    ``v`` ``[N, kv_heads, head_dim]``, at positions from 0) over itself only, with torch's fused attention;
    ``[N, heads * head_dim]``."""
    parts = []
    for n, at in zip(lengths, ends_of(lengths), strict=True):
        queries, keys, values = (x[at - n : at].transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, n, head_dim]
        attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        parts.append(attn[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(parts)


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_t: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention of the queries ``q`` (``[B, heads, head_dim]``, rotated) of the rows ``row_t`` of a
    range of cache slots over their ``keys`` and ``values`` (``[rows, kv_heads, width, head_dim]``), hidden where
    ``mask`` (``[rows, width]``) is True, with torch's fused attention; ``[B, heads * head_dim]``."""
    rows, kv_heads, _, head_dim = keys.shape
    group = q.shape[1] // kv_heads
    full = q.new_zeros((rows, kv_heads, group, head_dim))
    full[row_t] = q.view(-1, kv_heads, group, head_dim)
    # each kv head's query group as the query rows of one attention (one fused kernel; True attends)
    out = F.scaled_dot_product_attention(full, keys, values, attn_mask=~mask[:, None, None, :], scale=scale)
    return out[row_t].reshape(len(row_t), kv_heads * group * head_dim)  # out: [rows, kv_heads, group, head_dim]


def ends_of(lengths: Sequence[int]) -> list[int]:
    """The end (exclusive) of each of consecutive runs of ``lengths`` rows."""
    return list(itertools.accumulate(lengths))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of ``x`` (``[..., hidden]``), the operations of transformers' ``LlamaRMSNorm`` in order; a
    float32 ``x`` through torch's own ``rms_norm``, which runs the same operations (the same bits) with less
    overhead a call."""
    dtype = x.dtype
    if dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (``[B, heads, head_dim]``) at each row's position, ``cos`` and ``sin`` (``[B, 1,
    head_dim]``) as :func:`rotary_table` gives them: the bits of transformers' ``apply_rotary_pos_emb``, whose
    ``x * cos + cat(-x2, x1) * sin`` (``x1``, ``x2`` the halves of ``x``) is ``x * cos + cat(x2, x1) * cat(-sin1,
    sin2)`` exactly (a product's sign moves from one factor to the other without rounding), in three operations
    fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rotary_table(
    rotary: Any, positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` (``[positions, 1, head_dim]``, ``dtype``) of every position 0 .. ``positions - 1`` for the
    model's rotary module (its ``inv_freq`` and ``attention_scaling``), computed as transformers computes one position
    (the same float operations), the first half of each ``sin`` negated for :func:`rotate`."""
    at = torch.arange(positions, device=device).float()
    freqs = at[:, None] * rotary.inv_freq.to(device=device, dtype=torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rotary.attention_scaling
    cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos[:, None, :], sin[:, None, :]


def rows_computed_alone(
    ops: Callable[[torch.Tensor, torch.Tensor], Sequence[torch.Tensor]],
    rows: int,
    alone: list[tuple[torch.Tensor, ...]],
    like: torch.Tensor,
) -> bool:
    """Whether ``ops`` (``(x [rows, width], positions [rows]) -> tensors [rows, ...]``) gives each of ``rows`` random
    rows, together, the bits it gives that row alone: seeded rows (row ``i`` from seed ``i``; ``width``, dtype and
    device those of the 1-D tensor ``like``) at positions ``0 .. rows - 1``, through ``ops`` at once and one by one.
    ``alone`` caches the outputs of the rows alone between calls (row ``i`` at index ``i``)."""
    width = like.shape[0]

    def row(i: int) -> torch.Tensor:
        values = torch.randn(1, width, generator=torch.Generator().manual_seed(i))
        return values.to(dtype=like.dtype, device=like.device)

    positions = torch.arange(rows, device=like.device)
    while len(alone) < rows:
        i = len(alone)
        alone.append(tuple(t[0].clone() for t in ops(row(i), positions[i : i + 1])))
    together = ops(torch.cat([row(i) for i in range(rows)]), positions)
    return all(torch.equal(t[i], a) for i in range(rows) for t, a in zip(together, alone[i], strict=True))


def supported(model: PreTrainedModel) -> bool:
    """Whether :class:`SlotModel`'s forward computes ``model``: a ``LlamaForCausalLM`` with SiLU MLP, default rotary
    embedding (no scaling) and no sliding window."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    inner = getattr(model, "model", None)
    return (
        getattr(config, "model_type", None) == "llama"
        and type(model).__name__ == "LlamaForCausalLM"
        and getattr(config, "hidden_act", None) == "silu"
        and rope.get("rope_type", "default") == "default"
        and int(getattr(config, "pretraining_tp", 1) or 1) == 1
        and inner is not None
        and hasattr(inner, "rotary_emb")
        and hasattr(inner, "layers")
    )
