"""Tensor edits of the resident model (``engines/local/weights.py``) on the tiny model in process: slices, checks
that name the tensor and its shape, copy-on-write restore, and the chained content-digest revision."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save as save_safetensors

from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.weights import (
    WeightEditError,
    WriteSession,
    list_tensors,
    named_tensors,
    next_revision,
    parse_slice,
)

NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"


def test_slices_and_their_refusals() -> None:
    assert parse_slice(None, "t", (4, 3)) == ()
    assert parse_slice([[1, 3], None], "t", (4, 3)) == (slice(1, 3), slice(None))
    assert parse_slice([-1], "t", (4, 3)) == (-1,)
    for bad in ([[3, 1]], [9], [0, 0, 0], "0:2", [[0, 1, 2]], [True]):
        with pytest.raises(WeightEditError) as refused:
            parse_slice(bad, "t", (4, 3))
        assert refused.value.param == "slice" and "tensor 't' of shape [4, 3]" in refused.value.message


def test_revision_chains_contents_in_name_order() -> None:
    base = "sha256:000000000000"
    assert next_revision(base, {}) == base
    one = next_revision(base, {"a": "x", "b": "y"})
    assert one == next_revision(base, {"b": "y", "a": "x"}) and one != base and len(one) == len(base)
    assert next_revision(base, {"a": "x", "b": "z"}) != one


def test_write_restore_and_changed(engine: LocalEngine) -> None:
    loaded = engine.loaded
    infos = {t.name: t for t in list_tensors(loaded)}
    assert infos[NORM].shape == (64,) and infos[NORM].dtype == "float32"
    before = named_tensors(loaded)[EMBED].detach().clone()
    session = WriteSession()
    with pytest.raises(WeightEditError) as refused:
        session.write(loaded, EMBED, "set", [[1.0] * 64], [[0, 2]])
    assert refused.value.param == "value" and "[2, 64]" in refused.value.message
    assert not session.before  # a refused write copies and changes nothing
    session.write(loaded, EMBED, "set", 0.5, [[0, 2], [0, 8]])
    session.write(loaded, EMBED, "add", [[1.0] * 8, [2.0] * 8], [[0, 2], [0, 8]])
    session.write(loaded, NORM, "scale", 1.0, None)  # no change in content
    edited = named_tensors(loaded)[EMBED]
    assert torch.equal(edited[0, :8], torch.full((8,), 1.5)) and torch.equal(edited[1, :8], torch.full((8,), 2.5))
    assert torch.equal(edited[2:], before[2:])
    assert set(session.changed(loaded)) == {EMBED}
    session.restore(loaded)
    assert torch.equal(named_tensors(loaded)[EMBED], before)
    with pytest.raises(WeightEditError) as refused:
        session.write(loaded, NORM, "scale", [1.0] * 64, None)
    assert refused.value.param == "value"


def test_safetensors_uploads_are_checked_before_any_write(engine: LocalEngine) -> None:
    loaded = engine.loaded
    norm = named_tensors(loaded)[NORM].detach().clone()
    session = WriteSession()
    mixed = save_safetensors({NORM: torch.zeros(64), "model.nope": torch.zeros(2)})
    with pytest.raises(WeightEditError, match="model.nope"):
        session.write_safetensors(loaded, mixed, "set")
    with pytest.raises(WeightEditError, match=r"expected shape is \[64\]"):
        session.write_safetensors(loaded, save_safetensors({NORM: torch.zeros(65)}), "set")
    with pytest.raises(WeightEditError, match="expected dtype is float32"):
        session.write_safetensors(loaded, save_safetensors({NORM: torch.zeros(64, dtype=torch.bfloat16)}), "set")
    assert torch.equal(named_tensors(loaded)[NORM], norm)
    session.write_safetensors(loaded, save_safetensors({NORM: torch.ones(64)}), "add")
    assert torch.equal(named_tensors(loaded)[NORM], norm + 1)
    session.restore(loaded)
    assert torch.equal(named_tensors(loaded)[NORM], norm)
