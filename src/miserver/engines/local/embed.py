"""Pooled hidden states, alone or as one right-padded pack: embeddings and probe features (DESIGN §3.4).

Each input is pooled over its own tokens only (``mean``: the average of its positions; ``last``: its last
position), so the padding of a pack never enters a vector. Pooling and normalisation are done in float32 whatever
the model's dtype. Synchronous; runs under ``torch.inference_mode`` on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from transformers import PreTrainedModel

from miserver.engines.base import PoolRequest, Vector
from miserver.engines.local.score import pack_hidden


def check_layer(layer: int, num_layers: int) -> int:
    """``layer`` as an index of transformers' hidden states (``-1`` -> ``num_layers``); ``ValueError`` outside
    ``-(num_layers + 1) .. num_layers``."""
    if not -(num_layers + 1) <= layer <= num_layers:
        raise ValueError(f"layer {layer} is outside 0..{num_layers}")
    return layer % (num_layers + 1)


def pool_pack(model: PreTrainedModel, requests: Sequence[PoolRequest], *, pad_id: int, num_layers: int) -> list[Vector]:
    """One forward pass over the inputs of ``requests`` as one pack; a float32 ``[hidden]`` vector per request.

    Every request must name the same layer. Raises ``ValueError`` for an empty input, mixed layers or a layer out of
    range.
    """
    if not requests:
        return []
    layers = {check_layer(r.layer, num_layers) for r in requests}
    if len(layers) != 1:
        raise ValueError("a pack pools one layer")
    if any(not r.prompt_ids for r in requests):
        raise ValueError("an input has no tokens")
    layer = layers.pop()
    rows = [r.prompt_ids for r in requests]
    hidden = pack_hidden(model, rows, pad_id, -1 if layer == num_layers else layer)
    vectors = []
    for b, r in enumerate(requests):
        own = hidden[b, : len(r.prompt_ids)].float()  # [len, hidden]
        vec = own.mean(dim=0) if r.pooling == "mean" else own[-1]
        if r.normalize:
            vec = vec / vec.norm().clamp_min(1e-12)
        vectors.append(vec.cpu().numpy().astype(np.float32, copy=False))
    return vectors
