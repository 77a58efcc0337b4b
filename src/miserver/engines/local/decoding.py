"""How the resident engine's step loop decodes: :class:`DecodeOptions` and :func:`make_slots`, which picks the step
loop's cache (the slot forward of ``slots.SlotModel`` where the model allows it, else transformers' own cache in
``hf_cache.HFSlots``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from transformers import PreTrainedModel

from miserver.engines.local.hf_cache import HFSlots
from miserver.engines.local.llama_ops import supported
from miserver.engines.local.slot_weights import WeightLayout
from miserver.engines.local.slots import AttentionKind, KVCacheKind, SlotModel
from miserver.engines.local.steps import Slots

DecodePath = Literal["slots", "transformers"]


@dataclass(frozen=True)
class DecodeOptions:
    """How the step loop decodes: ``path`` ``"slots"`` (:class:`SlotModel` where :func:`supported`) or
    ``"transformers"`` (``hf_cache.HFSlots``); for the slot forward, its ``weights`` layout, its ``prefill`` (its own
    forward over the prompt, ``"slots"``, or transformers' bit for bit, ``"transformers"``) and ``compile`` (see
    :class:`SlotModel`), with inductor's compiled artefacts kept under ``compile_cache`` (None: inductor's default
    folder) so that a later start compiles from the cache; its decode ``attention`` and ``kv_cache`` dtype (see
    :class:`SlotModel`), the native attention kernel built under ``kernel_cache`` (None:
    ``native.default_folder()``); ``quantized_rows``, the largest decode step that multiplies a quantized model's
    matrices in their own bits (see :class:`SlotModel`; 0: never)."""

    path: DecodePath = "slots"
    weights: WeightLayout = "bfloat16"
    prefill: DecodePath = "slots"
    compile: bool = False
    compile_cache: Path | None = None
    attention: AttentionKind = "kernel"
    kv_cache: KVCacheKind = "bfloat16"
    kernel_cache: Path | None = None
    quantized_rows: int = 64


#: The default: the slot forward (prefill and decode), eager, with weights prepacked for oneDNN on the CPU, in
#: bfloat16 where the CPU multiplies bfloat16 natively; the decode step attends with the native kernel over a
#: bfloat16 KV cache where the kernel builds; a quantized model's matrices stay in their own bits in the prefill and
#: in steps of up to 64 rows (on an AVX-512 CPU the embedded model's steps of 1 to 64 rows took 0.43x to 0.85x the
#: bfloat16 ones; the scheduler's steps have at most MISERVER_MAX_SEQUENCES rows, 24 by default).
DEFAULT_DECODE = DecodeOptions()


def make_slots(model: PreTrainedModel, max_positions: int | None, options: DecodeOptions = DEFAULT_DECODE) -> Slots:
    """The step loop's cache for ``model``: a :class:`SlotModel` when ``options.path`` is ``"slots"``, the model is
    :func:`supported` and its context length ``max_positions`` is known; transformers' own cache
    (``hf_cache.HFSlots``) otherwise."""
    if options.path == "slots" and max_positions and supported(model):
        if options.compile and options.compile_cache is not None:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(options.compile_cache))
        return SlotModel(
            model,
            max_positions=max_positions,
            weights=options.weights,
            own_prefill=options.prefill == "slots",
            compile=options.compile,
            attention=options.attention,
            kv_cache=options.kv_cache,
            kernel_folder=options.kernel_cache,
            quantized_rows=options.quantized_rows,
        )
    return HFSlots(model, max_positions=max_positions)
