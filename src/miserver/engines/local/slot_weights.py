"""How the slot forward (``slots.SlotModel``) holds the model's weights: the layouts a projection can be multiplied
in, and the copies made for them, remade when a weight write changes their parameter.

Each layout is what ``llama_ops.project`` multiplies by: ``"view"``, a transposed view of the model's own ``[out,
in]`` weight (no copy); ``"transposed"``, a contiguous ``[in, out]`` copy; ``"packed"``, a copy prepacked for oneDNN
in the model's dtype; ``"bfloat16"``, a bfloat16 copy prepacked for oneDNN. Beside them, a quantized model's
matrices, as transformers dequantizes them from GGUF, can be held in their own bits for decode steps of a few rows:
4-bit ones (GGUF's Q4_1) as :class:`Int4Matrix` (found matrix by matrix by :func:`int4_groups`), 8-bit ones (GGUF's
Q8_0) as :class:`Int8Matrix` (:func:`int8_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar, cast, get_args

import torch
from transformers import PreTrainedModel

from miserver.engines.local.quantized import GROUP, Int4Tiles, Int8Tiles, QuantizedProducts, int4_tiles, int8_tiles

#: How the slot forward holds the projection weights and the output head (see :class:`SlotModel`).
WeightLayout = Literal["bfloat16", "packed", "transposed", "view"]
WEIGHT_LAYOUTS: tuple[WeightLayout, ...] = get_args(WeightLayout)


@dataclass(frozen=True)
class Int4Matrix:
    """A ``[out, in]`` weight held in 4 bits as GGUF's Q4_1 holds it (each weight ``d * q + m``, ``q`` 0 to 15), for
    the quantized product kernel (``llama_ops.project``): ``tiles`` its values, scales and minimums as the kernel
    reads them (``quantized.int4_tiles`` of :func:`int4_groups`); ``product`` the loaded kernel."""

    tiles: Int4Tiles
    product: QuantizedProducts


@dataclass(frozen=True)
class Int8Matrix:
    """A ``[out, in]`` weight held in 8 bits as GGUF's Q8_0 holds it (each weight ``d * q``, ``q`` an int8), for the
    quantized product kernel (``llama_ops.project``): ``tiles`` its values and scales as the kernel reads them
    (``quantized.int8_tiles`` of :func:`int8_groups`); ``product`` the loaded kernel."""

    tiles: Int8Tiles
    product: QuantizedProducts


#: What ``llama_ops.project`` multiplies by: a tensor in one of the layouts above, or a 4-bit or 8-bit matrix.
Matrix = torch.Tensor | Int4Matrix | Int8Matrix
_Copy = TypeVar("_Copy", bound="Matrix | None")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold prepacked weights for ``device`` and ``dtype``: a CPU build of torch with oneDNN
    (mkldnn), float32 or bfloat16."""
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]  # unannotated in torch
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn


def bfloat16_available() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 products natively (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(packed, scales, mins)``, as ``quantized.int4_tiles`` takes them, for ``weight`` (``[out, in]``, float32),
    when it is exactly a 4-bit matrix as GGUF's Q4_1 stores one and transformers dequantizes it: every 32 input
    columns of a row hold ``d * q + m`` computed in float32, with ``q`` in 0 to 15 and ``d``, ``m`` float16 values
    (the group's least value has ``q`` 0, its greatest 15, as Q4_1's quantizer makes them). None for any other
    weight (float, 8-bit, another grouping, an edited one): the values found are multiplied back and compared with
    ``weight`` bit for bit."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    if _four_bit(weight[:1]) is None:  # the first row first: most weights are not 4-bit, and this is cheap
        return None
    found = _four_bit(weight)
    if found is None:
        return None
    q, d, low = found  # q [out, in / 32, 32]
    nibbles = q.to(torch.uint8)
    packed = nibbles[..., : GROUP // 2] | (nibbles[..., GROUP // 2 :] << 4)
    out = weight.shape[0]
    return packed.reshape(out, -1).contiguous(), d[..., 0].contiguous(), low[..., 0].contiguous()


def _four_bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(q, d, m)`` of :func:`int4_groups` for ``weight`` (``q`` ``[out, in / group, group]``, ``d`` and ``m``
    ``[out, in / group, 1]``, float32), or None when it is not exactly 4-bit."""
    w = weight.detach().reshape(weight.shape[0], -1, GROUP)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((high - low) / 15).half().float()
    if not (torch.isfinite(d).all() and torch.equal(low.half().float(), low)):
        return None
    q = torch.where(d > 0, (w - low) / torch.where(d > 0, d, 1.0), 0.0).round().clamp(0, 15)
    if not torch.equal(d * q + low, w):
        return None
    return q, d, low


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q, scales)``, as ``quantized.int8_tiles`` takes them, for ``weight`` (``[out, in]``, float32), when it is
    exactly an 8-bit matrix as GGUF's Q8_0 stores one and transformers dequantizes it: every 32 input columns of a
    row hold ``d * q`` with ``q`` an int8 and ``d`` a float16 value, the group's largest magnitude being ``127 d``
    (as Q8_0's quantizer makes it). None for any other weight (float, 4-bit, another grouping, an edited one): the
    values found are multiplied back and compared with ``weight`` bit for bit."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    w = weight.detach()
    if _eight_bit(w[:1]) is None:  # the first row first: most weights are not 8-bit, and this is cheap
        return None
    return _eight_bit(w)


def _eight_bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`int8_groups` of ``weight`` without the shape checks."""
    w = weight.reshape(weight.shape[0], -1, GROUP)
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
    if not torch.isfinite(d).all():
        return None
    q = torch.where(d > 0, w / torch.where(d > 0, d, 1.0), 0.0).round()
    if q.abs().max() > 127 or not torch.equal(d * q, w):
        return None
    return q.to(torch.int8).reshape(weight.shape).contiguous(), d[..., 0].contiguous()


def has_quantized(model: PreTrainedModel) -> bool:
    """Whether ``model`` holds quantized matrices (exactly 4-bit or 8-bit, :func:`int4_groups`, :func:`int8_groups`):
    its first layer's query projection or its output head does."""
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
    weights = [model.model.layers[0].self_attn.q_proj.weight, head.weight]
    return any(int4_groups(w.detach()) is not None or int8_groups(w.detach()) is not None for w in weights)


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


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _layer_tensors(layers: torch.nn.ModuleList) -> list[torch.Tensor]:
    """The norm weights, then each projection's weight and bias (when it has one), of every decoder layer, read from
    the modules' ``_modules`` and ``_parameters`` dictionaries: what attribute access returns for modules that keep
    them there. Raises ``KeyError`` for a module that keeps one elsewhere."""
    out: list[torch.Tensor] = []
    for layer in layers:
        modules = layer._modules
        attention, mlp = modules["self_attn"]._modules, modules["mlp"]._modules  # type: ignore[union-attr]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(modules[norm]._parameters["weight"])  # type: ignore[union-attr,arg-type]
        for owner, names in ((attention, _ATTENTION), (mlp, _MLP)):
            for name in names:
                parameters = owner[name]._parameters  # type: ignore[union-attr]
                out += [t for t in (parameters["weight"], parameters["bias"]) if t is not None]
    return out


class WeightCopies:
    """The layer tensors and matrices of ``model`` in each layout, the copies kept between steps (one per parameter,
    or stack of parameters, and layout) and remade at the next use after a weight write. ``products`` is the
    quantized product kernel (None: quantized matrices stay in the layouts)."""

    def __init__(self, model: PreTrainedModel, products: QuantizedProducts | None = None) -> None:
        self.model = model
        self.products = products
        # (layout, quantized) -> (stamp of the tensors read, layers)
        self._layers: dict[tuple[str, bool], tuple[list[tuple[int, int, int]], list[Layer]]] = {}
        # (ids of the params, layout) -> ((data_ptr, version) of each, copy; None: no quantized form)
        self._copies: dict[tuple[tuple[int, ...], str], tuple[list[tuple[int, int]], object]] = {}

    def layers(self, layout: WeightLayout, *, quantized: bool = False) -> list[Layer]:
        """Each layer's tensors in ``layout``, read from the model now (weight edits replace or change them in
        place); with ``quantized``, every matrix held in its own bits instead where it can be (see :meth:`matrix`).
        The list is kept while every tensor it was read from is the same tensor, over the same storage, at the same
        version (checked at each call, a fraction of the cost of reading the list again)."""
        stamp = self._stamp()
        kept = self._layers.get((layout, quantized))
        if kept is not None and kept[0] == stamp:
            return kept[1]
        out = self._read_layers(layout, quantized)
        self._layers[(layout, quantized)] = (stamp, out)
        return out

    def _stamp(self) -> list[tuple[int, int, int]]:
        """``(id, data_ptr, version)`` of every tensor :meth:`layers` reads (an inference tensor's version as 0:
        it keeps none, and the layers hold views of it, which see its writes). The tensors are found through the
        modules' own dictionaries (a fifth of the cost of attribute access, which this runs at every step), or through
        their attributes where a module keeps one elsewhere (a parametrized weight, say)."""
        try:
            tensors = _layer_tensors(self.model.model.layers)
        except KeyError:
            tensors = self._layer_attributes()
        return [(id(t), t.data_ptr(), 0 if t.is_inference() else t._version) for t in tensors]

    def _layer_attributes(self) -> list[torch.Tensor]:
        """The tensors of :meth:`_stamp`, in the same order, by attribute."""
        out = []
        for layer in self.model.model.layers:
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for owner, names in ((layer.self_attn, _ATTENTION), (layer.mlp, _MLP)):
                for name in names:
                    linear = getattr(owner, name)
                    tensors += [linear.weight, linear.bias]
            out += [t for t in tensors if t is not None]
        return out

    def _read_layers(self, layout: WeightLayout, quantized: bool) -> list[Layer]:
        """:meth:`layers`, read from the model."""
        out = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out.append(
                Layer(
                    layer.input_layernorm.weight,
                    self.projections([attn.q_proj, attn.k_proj, attn.v_proj], layout, quantized=quantized),
                    self.matrix(attn.o_proj.weight, layout, quantized=quantized),
                    attn.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    self.projections([mlp.gate_proj, mlp.up_proj], layout, quantized=quantized),
                    self.matrix(mlp.down_proj.weight, layout, quantized=quantized),
                )
            )
        return out

    def projections(
        self, linears: list[torch.nn.Linear], layout: WeightLayout, *, quantized: bool = False
    ) -> Projections:
        """The ``linears`` (modules reading one input) as :class:`Projections` in ``layout``: one fused copy of their
        stacked weights (and biases), except in the ``"view"`` layout or when a weight is an inference tensor (its
        writes cannot be watched), where each keeps its own matrix; with ``quantized``, the fused matrix in its own
        bits where it can be (see :meth:`matrix`)."""
        weights = [m.weight for m in linears]
        biases = [m.bias for m in linears]
        sizes = tuple(int(w.shape[0]) for w in weights)
        if layout == "view" or any(w.is_inference() for w in weights):
            return Projections(tuple(self.matrix(w, layout) for w in weights), tuple(biases), sizes)

        def fused() -> torch.Tensor:
            return torch.cat([w.detach() for w in weights])

        matrix = self._quantized(weights, fused) if quantized else None
        if matrix is None:
            matrix = self._copy(weights, layout, lambda: self._made(fused(), layout))
        bias = None
        if any(b is not None for b in biases):
            parts = [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights, strict=True)]
            bias = self._copy(parts, "bias", lambda: torch.cat([p.detach() for p in parts]))
        return Projections((matrix,), (bias,), sizes)

    def matrix(self, weight: torch.Tensor, layout: WeightLayout, *, quantized: bool = False) -> Matrix:
        """What ``llama_ops.project`` multiplies by for the ``[out, in]`` ``weight``: its transposed
        view, or a copy (contiguous ``[in, out]``, or prepacked for oneDNN; with ``quantized`` and the kernel
        loaded, its own bits where it is exactly 4-bit, :func:`int4_groups`, or 8-bit, :func:`int8_groups`) remade
        when the parameter's storage or version changed since it was made."""
        if layout == "view" or weight.is_inference():  # an inference tensor keeps no version to watch
            return weight.t()
        if quantized and (own := self._quantized([weight], weight.detach)) is not None:
            return own
        return self._copy([weight], layout, lambda: self._made(weight.detach(), layout))

    def _quantized(self, sources: list[torch.Tensor], weight: Callable[[], torch.Tensor]) -> Matrix | None:
        """The ``[out, in]`` matrix ``weight()`` (made from ``sources``) in its own bits, or None (each answer kept
        as :meth:`_copy` keeps copies)."""
        products = self.products
        if products is None:
            return None

        def made() -> Int4Matrix | Int8Matrix | None:
            w = weight()
            if (four := int4_groups(w)) is not None:
                return Int4Matrix(int4_tiles(*four), products)
            eight = int8_groups(w)
            return None if eight is None else Int8Matrix(int8_tiles(*eight), products)

        return self._copy(sources, "quantized", made)

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
