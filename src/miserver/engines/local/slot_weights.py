"""How the slot forward (``slots.SlotModel``) holds the model's weights: the layouts a projection can be multiplied
in, and the copies made for them, remade when a weight write changes their parameter.

Each layout is what ``llama_ops.project`` multiplies by: ``"view"``, a transposed view of the model's own ``[out,
in]`` weight (no copy); ``"transposed"``, a contiguous ``[in, out]`` copy; ``"packed"``, a copy prepacked for oneDNN
in the model's dtype; ``"bfloat16"``, a bfloat16 copy prepacked for oneDNN.
"""

from __future__ import annotations

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
class Layer:
    """One decoder layer's tensors. A projection is what ``llama_ops.project`` takes: an ``[in, out]`` matrix (``x @
    m``: a transposed view of the model's own ``[out, in]`` weight, or a contiguous copy of it), or a oneDNN tensor
    prepacked from the ``[out, in]`` weight; biases are None when the model has none. Norm weights are the model's
    own."""

    norm_in: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm_post: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class WeightCopies:
    """The layer tensors and matrices of ``model`` in each layout, the copies kept between steps (one per parameter
    and layout) and remade at the next use after a weight write."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        # (id(param), layout) -> (data_ptr, version, copy)
        self._copies: dict[tuple[int, WeightLayout], tuple[int, int, torch.Tensor]] = {}

    def layers(self, layout: WeightLayout) -> list[Layer]:
        """Each layer's tensors in ``layout``, read from the model now (weight edits replace or change them in
        place)."""

        def m(weight: torch.Tensor) -> torch.Tensor:
            return self.matrix(weight, layout)

        out = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out.append(
                Layer(
                    layer.input_layernorm.weight,
                    m(attn.q_proj.weight),
                    attn.q_proj.bias,
                    m(attn.k_proj.weight),
                    attn.k_proj.bias,
                    m(attn.v_proj.weight),
                    attn.v_proj.bias,
                    m(attn.o_proj.weight),
                    attn.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    m(mlp.gate_proj.weight),
                    m(mlp.up_proj.weight),
                    m(mlp.down_proj.weight),
                )
            )
        return out

    def matrix(self, weight: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
        """What ``llama_ops.project`` multiplies by for the ``[out, in]`` ``weight``: its transposed
        view, or a copy (contiguous ``[in, out]``, or prepacked for oneDNN) remade when the parameter's storage or
        version changed since it was made."""
        if layout == "view" or weight.is_inference():  # an inference tensor keeps no version to watch
            return weight.t()
        key = (id(weight), layout)
        seen = self._copies.get(key)
        if seen is None or seen[0] != weight.data_ptr() or seen[1] != weight._version:
            if layout == "packed":
                copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            elif layout == "bfloat16":
                copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16))
            else:
                copy = weight.detach().t().contiguous()
            seen = (weight.data_ptr(), weight._version, copy)
            self._copies[key] = seen
        return seen[2]
