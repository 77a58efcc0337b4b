"""The decode step's native attention kernel (``engines/local/attention.py`` and ``attention.c``) and the slot forward
over it, float32 and bfloat16 caches, on random tensors and the tiny random Llama (CPU).

The kernel computes torch's attention within float32 rounding, each row over its own columns only (a column past a
row's length is never read, whatever it holds) and with the same bits alone or beside other rows; the build is
cached; without a compiler the slot forward attends with torch, in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from miserver.engines.local import attention
from miserver.engines.local import slots as slots_module
from miserver.engines.local.decoding import make_slots
from miserver.engines.local.loader import LoadedModel, load_model, resolve_model_source
from miserver.engines.local.slot_weights import WeightLayout
from miserver.engines.local.slots import AttentionKind, KVCacheKind, SlotModel
from tests.support.slot_runs import greedy, ids_of

PROMPTS = ["hello there", "tell me about the sea and the ships on it, and the sailors", "why"]


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build folder of the module's slot forwards: one build (seconds) for all of them."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def kernel(kernel_dir: Path) -> attention.DecodeAttention:
    built = attention.load(kernel_dir)
    assert built is not None, "the test machine has a C compiler (gcc)"
    return built


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    with torch.inference_mode():
        yield load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path_factory.mktemp("cache"), "cpu")


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
    """torch's attention of each row alone over its own columns, float32: ``[rows, heads * head_dim]``."""
    rows, heads, head_dim = q.shape
    out = []
    for r in range(rows):
        s, n = int(slot[r]), int(seen[r])
        k, v = keys[s : s + 1, :, :n].float(), values[s : s + 1, :, :n].float()
        one = F.scaled_dot_product_attention(
            q[r].view(1, heads, 1, head_dim), k, v, scale=head_dim**-0.5, enable_gqa=True
        )
        out.append(one.reshape(-1))
    return torch.stack(out)


def random_step(
    rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 96
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 1000 + heads * 10 + head_dim)
    q = torch.randn(rows, heads, head_dim, generator=generator) * 2
    keys = (torch.randn(rows + 3, kv_heads, capacity, head_dim, generator=generator) * 2).to(dtype)
    values = torch.randn(rows + 3, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    slot = torch.randperm(rows + 3, generator=generator)[:rows]  # out of order, with gaps
    seen = torch.randint(1, capacity + 1, (rows,), generator=generator)
    seen[0] = 1  # one column: a first decode step after a one-token prompt
    seen[-1] = capacity  # every column
    return q, keys, values, slot, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # every query group the kernel unrolls for head_dim 64 (1 to 4), and the generic loops up to the widest head_dim
    [(4, 2, 16), (4, 4, 64), (4, 2, 64), (9, 3, 64), (8, 2, 64), (10, 2, 64), (8, 8, 32), (16, 1, 128), (4, 2, 256)],
)
def test_the_kernel_computes_torch_attention(
    kernel: attention.DecodeAttention, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    q, keys, values, slot, seen = random_step(5, heads, kv_heads, head_dim, dtype)
    got = kernel(q, keys, values, slot, seen, head_dim**-0.5)
    assert got.shape == (5, heads * head_dim) and got.dtype == torch.float32
    assert torch.allclose(got, reference(q, keys, values, slot, seen), atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_or_in_company(kernel: attention.DecodeAttention, dtype: torch.dtype) -> None:
    q, keys, values, slot, seen = random_step(7, 9, 3, 64, dtype)
    together = kernel(q, keys, values, slot, seen, 0.125)
    for r in range(7):
        alone = kernel(q[r : r + 1], keys, values, slot[r : r + 1], seen[r : r + 1], 0.125)
        assert torch.equal(alone[0], together[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "views"])
def test_the_kernel_writes_each_rows_key_and_value_first(
    kernel: attention.DecodeAttention, dtype: torch.dtype, layout: str
) -> None:
    """Given each row's own key and value, the kernel writes them into column ``seen - 1`` of its slot, rounded as
    ``Tensor.to`` rounds (ties to even included), before any row attends: the same cache and the same attention as
    writing with torch first. Two rows of one slot (a prompt's) see each other's columns."""
    q, keys, values, slot, seen = random_step(6, 9, 3, 64, dtype)
    slot[1], seen[1], slot[2], seen[2] = slot[0], 7, slot[0], 8  # a prompt: rows at columns 6 and 7 of one slot
    generator = torch.Generator().manual_seed(5)
    fused = torch.randn(6, 9 + 3 + 3, 64, generator=generator)  # as the step's fused projection gives them
    fused[0, 9, :4] = torch.tensor([1.00390625, 1.01171875, -2.0078125, 3.0e-39])  # bfloat16 ties and a subnormal
    k, v = fused[:, 9:12], fused[:, 12:]
    if layout == "contiguous":
        k, v = k.contiguous(), v.contiguous()
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[slot, :, seen - 1] = k.to(dtype)
    expected_values[slot, :, seen - 1] = v.to(dtype)
    expected = kernel(q, expected_keys, expected_values, slot, seen, 0.125)
    got = kernel(q, keys, values, slot, seen, 0.125, k, v)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(keys.view(bits), expected_keys.view(bits))
    assert torch.equal(values.view(bits), expected_values.view(bits))
    assert torch.equal(got, expected)


def test_a_shape_the_kernel_does_not_cover_is_refused(kernel: attention.DecodeAttention) -> None:
    assert not attention.DecodeAttention.covers(4, 2, 272, torch.float32, torch.device("cpu"))
    assert not attention.DecodeAttention.covers(17, 1, 64, torch.float32, torch.device("cpu"))
    q, keys, values, slot, seen = random_step(2, 17, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="does not cover"):
        kernel(q, keys, values, slot, seen, 0.25)
    q, keys, values, slot, seen = random_step(2, 2, 1, 272, torch.float32)
    with pytest.raises(ValueError, match="does not cover"):
        kernel(q, keys, values, slot, seen, 0.25)


def test_a_row_never_reads_past_its_own_columns(kernel: attention.DecodeAttention) -> None:
    q, keys, values, slot, seen = random_step(4, 4, 2, 16, torch.float32)
    seen[:] = torch.tensor([1, 30, 50, 95])
    before = kernel(q, keys, values, slot, seen, 0.25)
    for r in range(4):  # what lies past each row's length: not a number
        keys[slot[r], :, int(seen[r]) :] = float("nan")
        values[slot[r], :, int(seen[r]) :] = float("nan")
    assert torch.equal(kernel(q, keys, values, slot, seen, 0.25), before)


def test_the_build_is_cached_per_source_compiler_and_processor(tmp_path: Path) -> None:
    first = attention.load(tmp_path)
    assert first is not None
    (built,) = tmp_path.glob("attention-*.so")
    stamp = built.stat().st_mtime_ns
    assert attention.load(tmp_path) is not None
    assert [p.name for p in tmp_path.iterdir()] == [built.name] and built.stat().st_mtime_ns == stamp


def test_without_a_compiler_the_decode_step_attends_with_torch(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert attention.load(tmp_path) is None
    assert "no C compiler" in caplog.text
    cache = SlotModel(loaded.model, max_positions=64, attention="kernel", kv_cache="bfloat16", kernel_folder=tmp_path)
    assert (cache.attention, cache.kv_cache, cache.kv_dtype) == ("sdpa", "model", torch.float32)


def test_a_failing_build_says_why_and_attends_with_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "attention.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(attention, "SOURCE", broken)
    assert attention.load(tmp_path / "kernels") is None
    assert "was not built" in caplog.text and "error" in caplog.text


def test_the_default_decode_step_uses_the_kernel_over_a_bfloat16_cache(loaded: LoadedModel) -> None:
    cache = make_slots(loaded.model, 512)
    assert isinstance(cache, SlotModel)
    assert (cache.attention, cache.kv_dtype) == ("kernel", torch.bfloat16)


def slots(loaded: LoadedModel, attention_kind: AttentionKind, kv_cache: KVCacheKind, folder: Path) -> SlotModel:
    cache = SlotModel(
        loaded.model,
        max_positions=512,
        weights="packed",
        attention=attention_kind,
        kv_cache=kv_cache,
        kernel_folder=folder,
    )
    assert cache.attention == attention_kind
    return cache


@pytest.mark.parametrize("kv_cache", ["model", "bfloat16"])
def test_the_slot_forward_over_the_kernel_decodes_as_over_torch_attention(
    loaded: LoadedModel, kernel_dir: Path, kv_cache: KVCacheKind
) -> None:
    with torch.inference_mode():
        for text in PROMPTS:
            ids = ids_of(loaded, text)
            want, torch_logits = greedy(slots(loaded, "sdpa", "model", kernel_dir), 0, ids, 16)
            got, logits = greedy(slots(loaded, "kernel", kv_cache, kernel_dir), 0, ids, 16)
            assert torch.equal(logits[0], torch_logits[0])  # the prefill attends before the cache
            if kv_cache == "model":
                assert got == want, text
                assert torch.allclose(logits, torch_logits, atol=1e-4, rtol=0)
            else:  # keys and values rounded to bfloat16: near, not equal
                assert torch.allclose(logits[1:2], torch_logits[1:2], atol=2e-2, rtol=0)


@pytest.mark.parametrize("kv_cache", ["model", "bfloat16"])
def test_a_slot_decoded_beside_others_gets_its_bits_alone(
    loaded: LoadedModel, kernel_dir: Path, kv_cache: KVCacheKind
) -> None:
    with torch.inference_mode():
        prompts = [ids_of(loaded, t) for t in PROMPTS]
        busy = slots(loaded, "kernel", kv_cache, kernel_dir)
        order = [4, 0, 2]
        firsts = [int(torch.argmax(busy.prefill(s, p))) for s, p in zip(order, prompts, strict=True)]
        together = busy.decode(order, firsts)
        for row, (p, first) in enumerate(zip(prompts, firsts, strict=True)):
            alone = slots(loaded, "kernel", kv_cache, kernel_dir)
            alone.prefill(0, p)
            assert torch.equal(alone.decode([0], [first])[0], together[row])


def test_a_slot_never_attends_past_its_own_length(loaded: LoadedModel, kernel_dir: Path) -> None:
    """Columns past a slot's length hold what an earlier, longer sequence left there; a step beside a longer slot
    must not read them."""
    with torch.inference_mode():
        cache = slots(loaded, "kernel", "model", kernel_dir)
        short, long = ids_of(loaded, PROMPTS[2]), ids_of(loaded, PROMPTS[1])
        first = int(torch.argmax(cache.prefill(0, short)))
        other = int(torch.argmax(cache.prefill(1, long)))
        clean = cache.decode([0, 1], [first, other])
        cache.prefill(0, short)
        cache.prefill(1, long)
        for layer in (*cache._kv.keys, *cache._kv.values):
            layer[0, :, len(short) + 1 :] = float("nan")
        assert torch.equal(cache.decode([0, 1], [first, other]), clean)


@pytest.mark.parametrize("weights", ["packed", "bfloat16"])
def test_independent_rows_says_what_a_step_does(loaded: LoadedModel, kernel_dir: Path, weights: WeightLayout) -> None:
    """Wherever the check says a step of ``rows`` slots gives each the bits of its step alone, it does."""
    with torch.inference_mode():
        prompts = [ids_of(loaded, PROMPTS[i % 3] + " x" * i) for i in range(6)]
        together = SlotModel(
            loaded.model, max_positions=512, weights=weights, attention="kernel", kernel_folder=kernel_dir
        )
        independent = [rows for rows in range(1, 7) if together.independent_rows(rows)]
        assert independent, "on this machine (oneDNN's prepacked products are row-independent here)"
        for rows in independent:
            firsts = [int(torch.argmax(together.prefill(s, p))) for s, p in enumerate(prompts[:rows])]
            step = together.decode(list(range(rows)), firsts)
            for s in range(rows):
                alone = SlotModel(
                    loaded.model, max_positions=512, weights=weights, attention="kernel", kernel_folder=kernel_dir
                )
                alone.prefill(0, prompts[s])
                assert torch.equal(alone.decode([0], [firsts[s]])[0], step[s]), (rows, s)


def test_independent_rows_catches_a_product_that_depends_on_the_company(
    loaded: LoadedModel, kernel_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = SlotModel(loaded.model, max_positions=512, weights="packed", attention="kernel", kernel_folder=kernel_dir)
    real = slots_module.project

    def company_dependent(x: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return real(x, matrix, bias) * (1 + 1e-6 * (x.shape[0] - 1))  # another rounding from 2 rows on

    monkeypatch.setattr(slots_module, "project", company_dependent)
    with torch.inference_mode():
        assert cache.independent_rows(1) and not cache.independent_rows(2)
    assert not SlotModel(loaded.model, max_positions=512, attention="sdpa").independent_rows(1)
