"""A 4-bit model's matrices held in their own 4 bits (``slot_weights.int4_groups``, the kernel of ``quantized.py``,
``SlotModel(quantized_rows=...)``).

A matrix is taken as 4-bit only when it is exactly what GGUF's Q4_1 dequantizes to (every group of 32 input columns
``d * q + m`` in float32, ``q`` 0 to 15, ``d`` and ``m`` float16). Its product rounds each row's inputs to 8 bits a
group (as llama.cpp does) and stays within that rounding of the float32 one; a row's bits never depend on the rest of
the product, nor on the processor's vector instructions. The prefill and decode steps of at most ``quantized_rows``
rows use it, larger steps the float32 layout bit for bit; a weight write that leaves a matrix not 4-bit sends it back
to the float32 layout at the next step.
"""

from __future__ import annotations

import copy
import ctypes
import platform
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from miserver.engines.local import native
from miserver.engines.local import quantized as quantized_kernel
from miserver.engines.local.loader import LoadedModel, load_model, resolve_model_source
from miserver.engines.local.slot_weights import Int4Matrix, int4_groups, int8_groups
from miserver.engines.local.slots import SlotModel
from tests.support.gguf_blocks import q4_1, q8_0
from tests.support.slot_runs import copy_cache, greedy, ids_of


def quantized(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` whose decoder layers' linear weights are Q4_1 (the embedding and head stay float32)."""
    four = copy.deepcopy(model)
    with torch.no_grad():
        for layer in four.model.layers:
            for linear in (
                *(layer.self_attn.get_submodule(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                *(layer.mlp.get_submodule(n) for n in ("gate_proj", "up_proj", "down_proj")),
            ):
                linear.weight.copy_(q4_1(linear.weight))
    return four


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    yield load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path_factory.mktemp("cache"), "cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> quantized_kernel.QuantizedProducts:
    built = quantized_kernel.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "the test machine has a C compiler (gcc)"
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_a_q4_1_matrix_is_found_and_multiplies_within_8_bit_rounding_of_its_inputs(
    kernel: quantized_kernel.QuantizedProducts, rows: int
) -> None:
    torch.manual_seed(rows)
    w = q4_1(torch.randn(40, 128) * 0.05)
    found = int4_groups(w)
    assert found is not None
    packed, scales, mins = found
    assert packed.dtype == torch.uint8 and packed.shape == (40, 64) and scales.shape == mins.shape == (40, 4)
    tiles = quantized_kernel.int4_tiles(packed, scales, mins)  # 40 outputs: three tiles, the last padded
    assert tiles.q.shape == (3, 4, 4, 16, 4) and tiles.scales.shape == (3, 4, 16) and tiles.out == 40
    # the identity's rows read each weight back (one input per group, which 8 bits hold exactly)
    assert torch.allclose(kernel.int4(torch.eye(128), tiles), w.t(), rtol=1e-6, atol=1e-7)
    x = torch.randn(rows, 128)
    y = kernel.int4(x, tiles)
    # each input moves by at most half its group's step (largest magnitude / 127 / 2)
    step = x.reshape(rows, 4, 32).abs().amax(-1).repeat_interleave(32, 1) / 254
    bound = step @ w.abs().t() + 1e-5
    assert ((y - x @ w.t()).abs() <= bound).all()
    for r in range(rows):  # a row's bits alone are its bits in company
        assert torch.equal(kernel.int4(x[r : r + 1], tiles)[0], y[r])


def test_the_kernel_refuses_shapes_it_does_not_cover(kernel: quantized_kernel.QuantizedProducts) -> None:
    packed, scales = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2)
    tiles = quantized_kernel.int4_tiles(packed, scales, scales)
    with pytest.raises(ValueError, match="quantized product"):
        kernel.int4(torch.zeros(1, 40), tiles)  # 40 inputs against 64
    with pytest.raises(ValueError, match="quantized product"):
        kernel.int4(torch.zeros(1, 64, dtype=torch.float64), tiles)
    with pytest.raises(ValueError, match="minimums"):
        quantized_kernel.int4_tiles(packed, scales, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="4-bit matrix"):
        quantized_kernel.int4_tiles(torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(4, 1), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="tiles of"):  # the values' groups disagree with the scales'
        quantized_kernel.Int4Tiles(tiles.q[:, :1], tiles.scales, tiles.mins, tiles.out)
    with pytest.raises(ValueError, match="tiles of"):  # more outputs than one tile holds
        quantized_kernel.Int4Tiles(tiles.q, tiles.scales, tiles.mins, 17)
    with pytest.raises(ValueError, match="quantized product"):
        kernel.int4(torch.zeros(1, 64, device="meta"), tiles)
    with pytest.raises(ValueError, match="tiles of"):  # not contiguous
        quantized_kernel.Int4Tiles(tiles.q, tiles.scales.transpose(1, 2).contiguous().transpose(1, 2), tiles.mins, 4)


def test_only_an_exact_4_bit_matrix_is_taken() -> None:
    torch.manual_seed(1)
    assert int4_groups(torch.randn(16, 64)) is None  # float
    w = q4_1(torch.randn(16, 64))
    assert int4_groups(w) is not None
    edited = w.clone()
    edited[5, 40] += 1e-3  # one weight off its group's grid
    assert int4_groups(edited) is None
    eight = (torch.randint(-127, 128, (16, 64)).float() * 0.01).half().float()  # 8-bit values: 255 levels a group
    assert int4_groups(eight) is None
    assert int4_groups(q4_1(torch.randn(16, 64))[:, :40]) is None  # 40 columns: not whole groups
    assert int4_groups(w.double()) is None


def test_a_model_with_no_4_bit_matrix_never_multiplies_in_4_bits(loaded: LoadedModel) -> None:
    cache = SlotModel(loaded.model, max_positions=256, weights="packed", own_prefill=True, quantized_rows=8)
    assert cache.quantized_rows == 0


@pytest.fixture(scope="module")
def four_bit(loaded: LoadedModel) -> PreTrainedModel:
    return quantized(loaded.model)


def test_the_prefill_and_small_steps_multiply_in_4_bits_and_larger_steps_in_float32(
    loaded: LoadedModel, four_bit: PreTrainedModel
) -> None:
    kwargs = {"max_positions": 256, "weights": "packed", "own_prefill": True, "attention": "kernel"}
    with torch.inference_mode():
        four = SlotModel(four_bit, quantized_rows=2, **kwargs)  # type: ignore[arg-type]
        full = SlotModel(four_bit, quantized_rows=0, **kwargs)  # type: ignore[arg-type]
        assert four.quantized_rows == 2
        assert isinstance(four._copies.layers("packed", quantized=True)[0].down, Int4Matrix)
        ids = ids_of(loaded, "tell me about the sea and the ships on it")
        got, logits = greedy(four, 0, ids, 12)
        want, ref = greedy(full, 0, ids, 12)
        assert not torch.equal(logits[0], ref[0])  # the prefill (the first token) multiplied in 4 bits
        assert not torch.equal(logits[1:], ref[1:])  # and so were the decode steps
        assert torch.allclose(logits, ref, atol=0.05, rtol=0)  # within 8-bit rounding of the inputs
        # from the same cache, a 3-row step (over quantized_rows) is the float32 step, bit for bit
        for s in (1, 2, 3):
            four.prefill(s, ids)
            full.prefill(s, ids)
        copy_cache(four, full)
        assert torch.equal(four.decode([1, 2, 3], [5, 6, 7]), full.decode([1, 2, 3], [5, 6, 7]))
        # a row's bits alone (1 row, 4-bit) differ from a 3-row step's (float32): batch-invariant rows decode alone
        assert four.independent_rows(2) and not four.independent_rows(3)


def test_a_weight_write_that_leaves_a_matrix_not_4_bit_sends_it_to_float32(four_bit: PreTrainedModel) -> None:
    model = copy.deepcopy(four_bit)
    cache = SlotModel(model, max_positions=256, weights="packed", own_prefill=True, quantized_rows=4)
    assert isinstance(cache._copies.layers("packed", quantized=True)[0].down, Int4Matrix)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.001)
    layer = cache._copies.layers("packed", quantized=True)[0]
    assert isinstance(layer.down, torch.Tensor) and layer.down.is_mkldnn  # remade: the float32 prepacked copy
    assert isinstance(layer.o, Int4Matrix)  # the others stay 4-bit
    with torch.inference_mode():
        cache.prefill(0, torch.tensor([1, 2, 3]))
        assert torch.isfinite(cache.decode([0], [4])).all()


@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_every_instruction_set_gives_the_quantized_products_the_same_bits(
    kernel: quantized_kernel.QuantizedProducts, tmp_path: Path, march: str
) -> None:
    """The kernel built for x86-64's baseline (one output at a time, ``fmaf``) and for AVX2 (8 outputs at a time)
    gives the bits of the kernel built for this processor (AVX-512 VNNI's 16 at a time where it has it), 4-bit and
    8-bit."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None:
        pytest.skip("builds for x86-64 with cc")
    if march == "haswell" and not {"avx2", "fma"} <= set(Path("/proc/cpuinfo").read_text().split()):
        pytest.skip("this processor has no AVX2 and FMA")
    flags = [f for f in native.FLAGS if f != "-march=native"]
    target = tmp_path / f"{march}.so"
    subprocess.run(["cc", *flags, f"-march={march}", "-o", str(target), str(quantized_kernel.SOURCE)], check=True)
    other = quantized_kernel.QuantizedProducts(ctypes.CDLL(str(target)))
    torch.manual_seed(3)
    w = q4_1(torch.randn(40, 96) * 0.05)
    found = int4_groups(w)
    assert found is not None
    tiles = quantized_kernel.int4_tiles(*found)
    x = torch.randn(5, 96)
    tiny = torch.finfo(torch.float32).smallest_normal / 2**23  # the least subnormal
    x[1, :32] = torch.arange(-16, 16) * 8.0 * tiny  # a group whose scale rounds to one subnormal: -128 clamped to -127
    x[2, 40] = float("nan")
    y = kernel.int4(x, tiles)
    assert torch.allclose(other.int4(x, tiles), y, rtol=0, atol=0, equal_nan=True)  # the same bits, NaN where NaN
    assert y[2].isnan().all() and y[[0, 1, 3, 4]].isfinite().all()  # a NaN input spoils its row, as in float32
    eight = q8_0(torch.randn(24, 96) * 0.05)
    found8 = int8_groups(eight)
    assert found8 is not None
    tiles8 = quantized_kernel.int8_tiles(*found8)
    y8 = kernel.int8(x, tiles8)
    assert torch.allclose(other.int8(x, tiles8), y8, rtol=0, atol=0, equal_nan=True)
    assert y8[2].isnan().all() and y8[[0, 1, 3, 4]].isfinite().all()
