"""An 8-bit model's matrices held in their own 8 bits (``slot_weights.int8_groups``, the kernel of
``quantized.py``, ``SlotModel(quantized_rows=...)``).

A matrix is taken as 8-bit only when it is exactly what GGUF's Q8_0 dequantizes to (every group of 32 input columns
``d * q`` in float32, ``q`` an int8, ``d`` float16). Its product rounds each row's inputs to 8 bits a group (as
llama.cpp does) and stays within that rounding of the float32 one; a row's bits never depend on the rest of the
product. The prefill and decode steps of at most ``quantized_rows`` rows use it, larger steps the float32 layout bit
for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from miserver.engines.local import quantized as quantized_kernel
from miserver.engines.local.loader import LoadedModel, load_model, resolve_model_source
from miserver.engines.local.slot_weights import Int8Matrix, int8_groups
from miserver.engines.local.slots import SlotModel
from tests.support.gguf_blocks import q8_0
from tests.support.slot_runs import copy_cache, greedy, ids_of


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build folder of the module's kernels: one build for all of them."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def kernel(kernel_dir: Path) -> quantized_kernel.QuantizedProducts:
    built = quantized_kernel.load(kernel_dir)
    assert built is not None, "the test machine has a C compiler (gcc)"
    return built


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    yield load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path_factory.mktemp("cache"), "cpu")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_the_kernel_computes_the_product_and_each_row_alone_has_its_bits(
    kernel: quantized_kernel.QuantizedProducts, rows: int
) -> None:
    torch.manual_seed(rows)
    w = q8_0(torch.randn(48, 96) * 0.05)
    found = int8_groups(w)
    assert found is not None
    q, scales = found
    assert q.dtype == torch.int8 and scales.shape == (48, 3)
    tiles = quantized_kernel.int8_tiles(q, scales)
    assert tiles.q.shape == (3, 3, 8, 16, 4) and tiles.offsets.dtype == torch.int32
    # the identity's rows read each weight back (one input per group, which 8 bits hold exactly)
    assert torch.allclose(kernel.int8(torch.eye(96), tiles), w.t(), rtol=1e-6, atol=1e-7)
    x = torch.randn(rows, 96)
    y = kernel.int8(x, tiles)
    # each input moves by at most half its group's step (largest magnitude / 127 / 2)
    step = x.reshape(rows, 3, 32).abs().amax(-1).repeat_interleave(32, 1) / 254
    assert ((y - x @ w.t()).abs() <= step @ w.abs().t() + 1e-5).all()
    for r in range(rows):
        assert torch.equal(kernel.int8(x[r : r + 1], tiles)[0], y[r])


def test_the_kernel_refuses_shapes_it_does_not_cover(kernel: quantized_kernel.QuantizedProducts) -> None:
    with pytest.raises(ValueError, match="8-bit matrix"):
        quantized_kernel.int8_tiles(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1))  # not whole groups
    with pytest.raises(ValueError, match="8-bit matrix"):
        quantized_kernel.int8_tiles(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="8-bit matrix"):
        quantized_kernel.int8_tiles(torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="-127 to 127"):
        quantized_kernel.int8_tiles(torch.full((4, 64), -128, dtype=torch.int8), torch.zeros(4, 2))
    tiles = quantized_kernel.int8_tiles(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="quantized product"):
        kernel.int8(torch.zeros(1, 32), tiles)
    with pytest.raises(ValueError, match="quantized product"):
        kernel.int8(torch.zeros(1, 64, dtype=torch.float64), tiles)


def test_only_an_exact_8_bit_matrix_is_taken() -> None:
    torch.manual_seed(1)
    assert int8_groups(torch.randn(16, 64)) is None  # float
    w = q8_0(torch.randn(16, 64))
    assert int8_groups(w) is not None
    edited = w.clone()
    edited[5, 40] += 1e-3  # one weight off its group's grid
    assert int8_groups(edited) is None
    assert int8_groups(w[:, :40]) is None  # 40 columns: not whole groups
    assert int8_groups(w.double()) is None
    scaled = w.clone()
    scaled[3] *= 1.001  # a row whose scale is no float16
    assert int8_groups(scaled) is None


def eight_bit(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` whose output head (tied to the embedding) is Q8_0, its layers float32."""
    eight = copy.deepcopy(model)
    with torch.no_grad():
        head = eight.get_output_embeddings().weight  # type: ignore[no-untyped-call]  # unannotated in transformers
        head.copy_(q8_0(head))
    return eight


def test_the_prefill_and_small_steps_multiply_the_8_bit_head_in_8_bits_and_larger_steps_in_float32(
    loaded: LoadedModel, kernel_dir: Path
) -> None:
    model = eight_bit(loaded.model)
    kwargs = {"max_positions": 256, "weights": "packed", "own_prefill": True, "attention": "kernel"}
    with torch.inference_mode():
        eight = SlotModel(model, quantized_rows=2, kernel_folder=kernel_dir, **kwargs)  # type: ignore[arg-type]
        full = SlotModel(model, quantized_rows=0, kernel_folder=kernel_dir, **kwargs)  # type: ignore[arg-type]
        assert eight.quantized_rows == 2
        head = model.get_output_embeddings().weight  # type: ignore[no-untyped-call]
        assert isinstance(eight._copies.matrix(head, "packed", quantized=True), Int8Matrix)
        ids = ids_of(loaded, "tell me about the sea and the ships on it")
        got, logits = greedy(eight, 0, ids, 12)
        want, ref = greedy(full, 0, ids, 12)
        assert not torch.equal(logits[0], ref[0])  # the prefill (the first token) multiplied in 8 bits too
        assert torch.allclose(logits, ref, atol=0.05, rtol=0)  # within 8-bit rounding of the inputs
        # from the same cache, a 3-row step (over quantized_rows) is the float32 step, bit for bit
        for s in (1, 2, 3):
            eight.prefill(s, ids)
            full.prefill(s, ids)
        copy_cache(eight, full)
        assert torch.equal(eight.decode([1, 2, 3], [5, 6, 7]), full.decode([1, 2, 3], [5, 6, 7]))
        assert eight.independent_rows(2)


def test_without_a_compiler_an_8_bit_head_stays_float32(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cache = SlotModel(eight_bit(loaded.model), max_positions=64, weights="packed", quantized_rows=4)
    assert cache.quantized_rows == 0
    assert "no C compiler" in caplog.text
