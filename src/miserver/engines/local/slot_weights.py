"""How the slot forward (``slots.SlotModel``) holds the model's weights: the layouts a projection can be multiplied
in, and the copies made for them, remade when a weight write changes their parameter.

Each layout is what ``llama_ops.project`` multiplies by: ``"view"``, a transposed view of the model's own ``[out,
in]`` weight (no copy); ``"transposed"``, a contiguous ``[in, out]`` copy; ``"packed"``, a copy prepacked for oneDNN
in the model's dtype; ``"bfloat16"``, a bfloat16 copy prepacked for oneDNN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from transformers import PreTrainedModel

#: How the slot forward holds the projection weights and the output head (see :class:`SlotModel`).
WeightLayout = Literal["bfloat16", "packed", "transposed", "view"]
WEIGHT_LAYOUTS: tuple[WeightLayout, ...] = get_args(WeightLayout)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold prepacked weights for ``device`` and ``dtype``: a CPU build of torch with oneDNN
    (mkldnn), float32 or bfloat16."""
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]  # unannotated in torch
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn


def bfloat16_available() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 products natively (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class Projections:
    """Projections of one input, multiplied together: ``matrices`` holds one fused matrix (the weights stacked along
    their outputs, in one of the layouts above), or, in the ``"view"`` layout (no copy) and for weights whose writes
    cannot be watched, one matrix per projection; ``biases`` match ``matrices`` (None: no bias); ``sizes`` are the
    projections' output widths. ``llama_ops.project_all`` multiplies them."""

    matrices: tuple[torch.Tensor, ...]
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
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm_post: torch.Tensor
    gate_up: Projections
    down: torch.Tensor


class WeightCopies:
    """The layer tensors and matrices of ``model`` in each layout, the copies kept between steps (one per parameter,
    or stack of parameters, and layout) and remade at the next use after a weight write."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        # (ids of the params, layout) -> ((data_ptr, version) of each, copy)
        self._copies: dict[tuple[tuple[int, ...], str], tuple[list[tuple[int, int]], torch.Tensor]] = {}

    def layers(self, layout: WeightLayout) -> list[Layer]:
        """Each layer's tensors in ``layout``, read from the model now (weight edits replace or change them in
        place)."""
        out = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out.append(
                Layer(
                    layer.input_layernorm.weight,
                    self.projections([attn.q_proj, attn.k_proj, attn.v_proj], layout),
                    self.matrix(attn.o_proj.weight, layout),
                    attn.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    self.projections([mlp.gate_proj, mlp.up_proj], layout),
                    self.matrix(mlp.down_proj.weight, layout),
                )
            )
        return out

    def projections(self, linears: list[torch.nn.Linear], layout: WeightLayout) -> Projections:
        """The ``linears`` (modules reading one input) as :class:`Projections` in ``layout``: one fused copy of their
        stacked weights (and biases), except in the ``"view"`` layout or when a weight is an inference tensor (its
        writes cannot be watched), where each keeps its own matrix."""
        weights = [m.weight for m in linears]
        biases = [m.bias for m in linears]
        sizes = tuple(int(w.shape[0]) for w in weights)
        if layout == "view" or any(w.is_inference() for w in weights):
            return Projections(tuple(self.matrix(w, layout) for w in weights), tuple(biases), sizes)
        matrix = self._copy(weights, layout, lambda: self._made(torch.cat([w.detach() for w in weights]), layout))
        bias = None
        if any(b is not None for b in biases):
            parts = [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights, strict=True)]
            bias = self._copy(parts, "bias", lambda: torch.cat([p.detach() for p in parts]))
        return Projections((matrix,), (bias,), sizes)

    def matrix(self, weight: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
        """What ``llama_ops.project`` multiplies by for the ``[out, in]`` ``weight``: its transposed
        view, or a copy (contiguous ``[in, out]``, or prepacked for oneDNN) remade when the parameter's storage or
        version changed since it was made."""
        if layout == "view" or weight.is_inference():  # an inference tensor keeps no version to watch
            return weight.t()
        return self._copy([weight], layout, lambda: self._made(weight.detach(), layout))

    @staticmethod
    def _made(weight: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
        """The copy of the ``[out, in]`` ``weight`` in ``layout`` (not ``"view"``)."""
        if layout in ("packed", "bfloat16"):
            source = weight.to(torch.bfloat16) if layout == "bfloat16" else weight
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(source)
            return packed
        return weight.t().contiguous()

    def _copy(self, sources: Sequence[torch.Tensor], tag: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The copy made by ``make()`` from ``sources`` under ``tag``, kept until a source's storage or version
        changes."""
        key = (tuple(id(t) for t in sources), tag)
        stamp = [(t.data_ptr(), t._version) for t in sources]
        seen = self._copies.get(key)
        if seen is None or seen[0] != stamp:
            seen = (stamp, make())
            self._copies[key] = seen
        return seen[1]
