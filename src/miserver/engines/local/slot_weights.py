"""How the slot forward (``slots.SlotModel``) holds the model's weights: the layouts a projection can be multiplied
in, and the copies made for them, remade when a weight write changes their parameter.

Each layout is what ``llama_ops.project`` multiplies by: ``"view"``, a transposed view of the model's own ``[out,
in]`` weight (no copy); ``"transposed"``, a contiguous ``[in, out]`` copy; ``"packed"``, a copy prepacked for oneDNN
in the model's dtype; ``"bfloat16"``, a bfloat16 copy prepacked for oneDNN. Beside them, a 4-bit model's matrices
(GGUF's Q4_1, as transformers dequantizes it) can be held in their own 4 bits (:class:`Int4Matrix`, found matrix by
matrix by :func:`int4_groups`), for decode steps of a few rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, cast, get_args

import torch
from transformers import PreTrainedModel

#: How the slot forward holds the projection weights and the output head (see :class:`SlotModel`).
WeightLayout = Literal["bfloat16", "packed", "transposed", "view"]
WEIGHT_LAYOUTS: tuple[WeightLayout, ...] = get_args(WeightLayout)
#: Input columns per group of a 4-bit matrix: the block of GGUF's Q4_1, a group size torch's int4 kernel takes.
INT4_GROUP = 32


@dataclass(frozen=True)
class Int4Matrix:
    """A ``[out, in]`` weight held in 4 bits, for torch's int4 kernel (``llama_ops.project``): ``packed`` is its
    values ``q`` (0 to 15) in the kernel's layout, ``scales_zeros`` (``[in / group, out, 2]``, bfloat16) each group's
    scale and zero point, the weight being ``(q - 8) * scale + zero``; ``group`` input columns share them."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    group: int


#: What ``llama_ops.project`` multiplies by: a tensor in one of the layouts above, or a 4-bit matrix.
Matrix = torch.Tensor | Int4Matrix
_Copy = TypeVar("_Copy", bound="Matrix | None")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold prepacked weights for ``device`` and ``dtype``: a CPU build of torch with oneDNN
    (mkldnn), float32 or bfloat16."""
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]  # unannotated in torch
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn


def bfloat16_available() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 products natively (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int4_available(device: torch.device) -> bool:
    """Whether torch's int4 kernel for the CPU is there, and ``device`` is a CPU."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int4_groups(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Matrix | None:
    """``weight`` (``[out, in]``, float32) in 4 bits, when it is exactly a 4-bit matrix as GGUF's Q4_1 stores one
    and transformers dequantizes it: every ``group`` input columns of a row hold ``d * q + m`` computed in float32,
    with ``q`` in 0 to 15 and ``d``, ``m`` float16 values (the group's least value has ``q`` 0, its greatest 15, as
    Q4_1's quantizer makes them). None for any other weight (float, 8-bit, another grouping, an edited one, or one
    whose outputs are not a multiple of 16, which the kernel needs): the values found are multiplied back and
    compared with ``weight`` bit for bit.

    The kernel's scale and zero point are bfloat16: ``d`` and ``m + 8 d`` rounded to 8 significant bits, so a weight
    moves by at most ``d / 64`` plus ``2**-9`` of ``|m + 8 d|`` (in a group that straddles zero, as Llama's do,
    ``m + 8 d`` is a few ``d`` at most, so about ``d / 64`` in all); the ``"bfloat16"`` layout rounds each weight by
    up to ``2**-9`` of its size."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % group or weight.shape[0] % 16:
        return None  # the kernel takes whole groups, and outputs in 16s
    out, width = weight.shape
    if _four_bit(weight[:1]) is None:  # the first row first: most weights are not 4-bit, and this is cheap
        return None
    found = _four_bit(weight)
    if found is None:
        return None
    q, d, low = found
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out, width).to(torch.int32), 1)
    scales_zeros = torch.stack([d[..., 0].t(), (low + 8 * d)[..., 0].t()], dim=-1).to(torch.bfloat16)
    return Int4Matrix(packed, scales_zeros.contiguous(), group)


def _four_bit(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(q, d, m)`` of :func:`int4_groups` for ``weight`` (``q`` ``[out, in / group, group]``, ``d`` and ``m``
    ``[out, in / group, 1]``, float32), or None when it is not exactly 4-bit."""
    w = weight.detach().reshape(weight.shape[0], -1, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((high - low) / 15).half().float()
    if not (torch.isfinite(d).all() and torch.equal(low.half().float(), low)):
        return None
    q = torch.where(d > 0, (w - low) / torch.where(d > 0, d, 1.0), 0.0).round().clamp(0, 15)
    if not torch.equal(d * q + low, w):
        return None
    return q, d, low


@dataclass(frozen=True)
class Projections:
    """Projections of one input, multiplied together: ``matrices`` holds one fused matrix (the weights stacked along
    their outputs, in one of the layouts above), or, in the ``"view"`` layout (no copy) and for weights whose writes
    cannot be watched, one matrix per projection; ``biases`` match ``matrices`` (None: no bias); ``sizes`` are the
    projections' output widths. ``llama_ops.project_all`` multiplies them."""

    matrices: tuple[Matrix, ...]
    biases: tuple[torch.Tensor | None, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Layer:
    """One decoder layer's tensors: the query, key and value projections (``qkv``), the output projection ``o`` and
    its bias, the SwiGLU gate and up projections (``gate_up``) and the down projection ``down``. ``o`` and ``down``
    are what ``llama_ops.project`` takes (an ``[in, out]`` matrix, or a oneDNN tensor prepacked from the ``[out, in]``
    weight). Norm weights are the model's own."""

    norm_in: torch.Tensor
    qkv: Projections
    o: Matrix
    o_bias: torch.Tensor | None
    norm_post: torch.Tensor
    gate_up: Projections
    down: Matrix


class WeightCopies:
    """The layer tensors and matrices of ``model`` in each layout, the copies kept between steps (one per parameter,
    or stack of parameters, and layout) and remade at the next use after a weight write."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        # (ids of the params, layout) -> ((data_ptr, version) of each, copy; None: no 4-bit form)
        self._copies: dict[tuple[tuple[int, ...], str], tuple[list[tuple[int, int]], object]] = {}

    def layers(self, layout: WeightLayout, *, int4: bool = False) -> list[Layer]:
        """Each layer's tensors in ``layout``, read from the model now (weight edits replace or change them in
        place); with ``int4``, every matrix that is exactly 4-bit (:func:`int4_groups`) as an :class:`Int4Matrix`
        instead."""
        out = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out.append(
                Layer(
                    layer.input_layernorm.weight,
                    self.projections([attn.q_proj, attn.k_proj, attn.v_proj], layout, int4=int4),
                    self.matrix(attn.o_proj.weight, layout, int4=int4),
                    attn.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    self.projections([mlp.gate_proj, mlp.up_proj], layout, int4=int4),
                    self.matrix(mlp.down_proj.weight, layout, int4=int4),
                )
            )
        return out

    def has_int4(self, layout: WeightLayout) -> bool:
        """Whether the model is 4-bit: its first layer's fused query, key and value matrix is (:func:`int4_groups`)."""
        return isinstance(self.layers(layout, int4=True)[0].qkv.matrices[0], Int4Matrix)

    def projections(self, linears: list[torch.nn.Linear], layout: WeightLayout, *, int4: bool = False) -> Projections:
        """The ``linears`` (modules reading one input) as :class:`Projections` in ``layout``: one fused copy of their
        stacked weights (and biases), except in the ``"view"`` layout or when a weight is an inference tensor (its
        writes cannot be watched), where each keeps its own matrix; with ``int4``, the fused matrix in 4 bits where
        it is 4-bit."""
        weights = [m.weight for m in linears]
        biases = [m.bias for m in linears]
        sizes = tuple(int(w.shape[0]) for w in weights)
        if layout == "view" or any(w.is_inference() for w in weights):
            return Projections(tuple(self.matrix(w, layout) for w in weights), tuple(biases), sizes)

        def fused() -> torch.Tensor:
            return torch.cat([w.detach() for w in weights])

        matrix: Matrix | None = self._copy(weights, "int4", lambda: int4_groups(fused())) if int4 else None
        if matrix is None:
            matrix = self._copy(weights, layout, lambda: self._made(fused(), layout))
        bias = None
        if any(b is not None for b in biases):
            parts = [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights, strict=True)]
            bias = self._copy(parts, "bias", lambda: torch.cat([p.detach() for p in parts]))
        return Projections((matrix,), (bias,), sizes)

    def matrix(self, weight: torch.Tensor, layout: WeightLayout, *, int4: bool = False) -> Matrix:
        """What ``llama_ops.project`` multiplies by for the ``[out, in]`` ``weight``: its transposed
        view, or a copy (contiguous ``[in, out]``, or prepacked for oneDNN; with ``int4``, its 4 bits where it is
        4-bit) remade when the parameter's storage or version changed since it was made."""
        if layout == "view" or weight.is_inference():  # an inference tensor keeps no version to watch
            return weight.t()
        if int4 and (four := self._copy([weight], "int4", lambda: int4_groups(weight.detach()))) is not None:
            return four
        return self._copy([weight], layout, lambda: self._made(weight.detach(), layout))

    @staticmethod
    def _made(weight: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
        """The copy of the ``[out, in]`` ``weight`` in ``layout`` (not ``"view"``)."""
        if layout in ("packed", "bfloat16"):
            source = weight.to(torch.bfloat16) if layout == "bfloat16" else weight
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(source)
            return packed
        return weight.t().contiguous()

    def _copy(self, sources: Sequence[torch.Tensor], tag: str, make: Callable[[], _Copy]) -> _Copy:
        """The copy made by ``make()`` from ``sources`` under ``tag``, kept until a source's storage or version
        changes."""
        key = (tuple(id(t) for t in sources), tag)
        stamp = [(t.data_ptr(), t._version) for t in sources]
        seen = self._copies.get(key)
        if seen is None or seen[0] != stamp:
            seen = (stamp, make())
            self._copies[key] = seen
        return cast(_Copy, seen[1])  # each tag's copies come from one kind of ``make``
