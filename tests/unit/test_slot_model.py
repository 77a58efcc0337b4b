"""The static-cache slot forward (``engines/local/slots.py``) on the tiny random Llama, float32, CPU.

Greedy tokens equal transformers' ``generate`` token for token and logits stay within float32 rounding of
transformers' forward; a slot decoded beside others at other lengths computes what it computes alone (within rounding),
and alone always the same bits; fork, release, growth past the first capacity and the context limit hold; models the
forward does not cover fall back to transformers' cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from miserver.engines.local import kv_cache, slot_weights
from miserver.engines.local import slots as slots_module
from miserver.engines.local.decoding import DecodeOptions, make_slots
from miserver.engines.local.hf_cache import HFSlots
from miserver.engines.local.llama_ops import rms_norm, rotary_table, rotate, supported
from miserver.engines.local.loader import LoadedModel, load_model, resolve_model_source
from miserver.engines.local.slot_weights import WEIGHT_LAYOUTS, WeightLayout, bfloat16_available
from miserver.engines.local.slots import SlotModel
from miserver.engines.local.steps import StepInterrupted
from tests.support.slot_runs import greedy, ids_of

PROMPTS = ["hello there", "tell me about the sea and the ships on it, and the sailors", "why", "a b c d e f g"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    with torch.inference_mode():
        yield load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path_factory.mktemp("cache"), "cpu")


#: The layouts that multiply in the model's own dtype (float32 here).
FULL_PRECISION = [w for w in WEIGHT_LAYOUTS if w != "bfloat16"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_wise_operations_have_the_bits_of_transformers(dtype: torch.dtype) -> None:
    """RMSNorm and the rotary embedding (a roll and a sine table with its first half negated) give the bits of
    transformers' ``LlamaRMSNorm`` and ``apply_rotary_pos_emb``, for every row count a step or prefill has."""
    generator = torch.Generator().manual_seed(3)
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512)
    rotary = LlamaRotaryEmbedding(config)
    cos_table, sin_table = rotary_table(rotary, 512, torch.device("cpu"), dtype)
    for rows in (1, 2, 3, 8, 17, 64):
        scales = 10 ** (torch.rand(rows, 1, generator=generator) * 4 - 3)  # where eps matters, and where not
        x = (torch.randn(rows, 576, generator=generator) * scales).to(dtype)
        norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(576, generator=generator).to(dtype)
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))
        positions = torch.randint(0, 512, (rows,), generator=generator)
        q = torch.randn(rows, 12, 64, generator=generator).to(dtype)  # queries and keys as one tensor
        cos, sin = rotary(q, positions[None])  # [1, rows, 64]
        want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
        got = rotate(q, cos_table[positions], sin_table[positions])
        assert torch.equal(got, want[0].transpose(0, 1))


def test_the_tiny_model_is_covered(loaded: LoadedModel) -> None:
    assert supported(loaded.model)
    default = make_slots(loaded.model, 512)
    # the CPU default: bfloat16 products where the CPU has them natively, else float32 (torch with oneDNN)
    assert isinstance(default, SlotModel) and default.weights == ("bfloat16" if bfloat16_available() else "packed")
    assert isinstance(make_slots(loaded.model, 512, DecodeOptions("transformers")), HFSlots)
    assert isinstance(make_slots(loaded.model, None), HFSlots)
    views = make_slots(loaded.model, 512, DecodeOptions(weights="view"))
    assert isinstance(views, SlotModel) and views.weights == "view"


@pytest.mark.parametrize("own_prefill", [False, True])
@pytest.mark.parametrize("weights", FULL_PRECISION)
def test_greedy_equals_transformers_generate(loaded: LoadedModel, weights: WeightLayout, own_prefill: bool) -> None:
    model = loaded.model
    with torch.inference_mode():
        for text in PROMPTS:
            ids = ids_of(loaded, text)
            ref = model.generate(ids[None], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
            want = ref[0, len(ids) :].tolist()
            cache = SlotModel(model, max_positions=512, weights=weights, own_prefill=own_prefill)
            got, logits = greedy(cache, 0, ids, 24)
            assert got == want, text
            _, hf_logits = greedy(HFSlots(model, max_positions=512), 0, ids, 24)
            if not own_prefill:
                assert torch.equal(logits[0], hf_logits[0])  # the prefill is transformers' own
            assert torch.allclose(logits, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.skipif(not bfloat16_available(), reason="this CPU has no native bfloat16 products (layout falls back)")
@pytest.mark.parametrize("own_prefill", [False, True])
def test_bfloat16_products_stay_near_float32(loaded: LoadedModel, own_prefill: bool) -> None:
    """The prefill stays float32 (the first token's logits are float32's, bit for bit, with the own prefill);
    rounding each decode product's input and weights to bfloat16 moves the later logits by a little."""
    with torch.inference_mode():
        for text in PROMPTS:
            ids = ids_of(loaded, text)
            full = SlotModel(loaded.model, max_positions=512, weights="packed", own_prefill=own_prefill)
            want, ref = greedy(full, 0, ids, 24)
            cache = SlotModel(loaded.model, max_positions=512, weights="bfloat16", own_prefill=own_prefill)
            assert cache.weights == "bfloat16"
            logits = [cache.prefill(0, ids)] + [cache.decode([0], [t])[0] for t in want[:-1]]
            got = torch.stack(logits)
            assert got.dtype == torch.float32
            assert torch.equal(got[0], ref[0]), "the prefill multiplies in float32"
            assert not torch.equal(got[1:], ref[1:]), "the decode products ran in bfloat16"
            scale = ref.abs().max()
            assert (got - ref).abs().max() < 0.05 * scale, text


def test_bfloat16_falls_back_to_float32_without_native_products(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slots_module, "bfloat16_available", lambda: False)
    assert SlotModel(loaded.model, max_positions=512, weights="bfloat16").weights == "packed"


def test_the_own_prefill_fills_the_cache_as_transformers_does(loaded: LoadedModel) -> None:
    with torch.inference_mode():
        ids = ids_of(loaded, PROMPTS[1])
        own = SlotModel(loaded.model, max_positions=512, weights="packed", own_prefill=True)
        theirs = SlotModel(loaded.model, max_positions=512, weights="packed")
        own.prefill(3, ids)
        theirs.prefill(3, ids)
        n = len(ids)
        assert own.length(3) == theirs.length(3) == n
        for mine, ref in zip(own._kv.keys + own._kv.values, theirs._kv.keys + theirs._kv.values, strict=True):
            assert torch.allclose(mine[3, :, :n], ref[3, :, :n], atol=1e-5, rtol=0)
            assert not mine[3, :, n:].any(), "nothing written past the prompt"


@pytest.mark.parametrize("weights", WEIGHT_LAYOUTS)
def test_slots_at_other_lengths_decode_together(loaded: LoadedModel, weights: WeightLayout) -> None:
    with torch.inference_mode():
        cache = SlotModel(loaded.model, max_positions=512, weights=weights)
        prompts = [ids_of(loaded, t) for t in PROMPTS[:3]]
        order = [2, 0, 5]  # slot numbers out of order, with a gap (slots 1, 3, 4 hold nothing)
        firsts = [int(torch.argmax(cache.prefill(s, p))) for s, p in zip(order, prompts, strict=True)]
        together = [cache.decode(order, firsts)]
        nexts = [int(t) for t in torch.argmax(together[0], dim=-1)]
        together.append(cache.decode(order, nexts))
        assert [cache.length(s) for s in order] == [len(p) + 2 for p in prompts]
        for row, (p, first, nxt) in enumerate(zip(prompts, firsts, nexts, strict=True)):
            alone = SlotModel(loaded.model, max_positions=512, weights=weights)
            alone.prefill(0, p)
            one = alone.decode([0], [first])[0]
            two = alone.decode([0], [nxt])[0]
            assert torch.allclose(one, together[0][row], atol=1e-5, rtol=0)
            assert torch.allclose(two, together[1][row], atol=1e-5, rtol=0)


def test_a_decode_step_given_up_part_way_changes_nothing(loaded: LoadedModel) -> None:
    """``decode`` with a ``stop`` that turns true before layer 1 raises ``StepInterrupted``: no slot grows, and
    feeding the same tokens again gives the bits of a step never interrupted."""
    with torch.inference_mode():
        prompts = [ids_of(loaded, t) for t in PROMPTS[:2]]
        caches = [SlotModel(loaded.model, max_positions=512) for _ in range(2)]
        firsts = [[int(torch.argmax(c.prefill(s, p))) for s, p in enumerate(prompts)] for c in caches]
        asked: list[int] = []

        def stop() -> bool:
            asked.append(1)
            return len(asked) > 1  # true before the second layer

        with pytest.raises(StepInterrupted):
            caches[0].decode([0, 1], firsts[0], stop)
        assert len(asked) == 2 and [caches[0].length(s) for s in (0, 1)] == [len(p) for p in prompts]
        again = caches[0].decode([0, 1], firsts[0], lambda: False)
        never = caches[1].decode([0, 1], firsts[1])
        assert torch.equal(again, never)
        assert [caches[0].length(s) for s in (0, 1)] == [len(p) + 1 for p in prompts]


@pytest.mark.parametrize("weights", WEIGHT_LAYOUTS)
def test_a_slot_alone_computes_the_same_bits_whatever_else_is_cached(
    loaded: LoadedModel, weights: WeightLayout
) -> None:
    with torch.inference_mode():
        ids = ids_of(loaded, PROMPTS[1])
        clean = SlotModel(loaded.model, max_positions=512, weights=weights)
        _, first = greedy(clean, 0, ids, 8)
        busy = SlotModel(loaded.model, max_positions=512, weights=weights)
        for s, text in enumerate(PROMPTS):
            busy.prefill(s, ids_of(loaded, text))
        _, second = greedy(busy, 1, ids, 8)
        assert torch.equal(first, second)


@pytest.mark.parametrize("weights", WEIGHT_LAYOUTS)
def test_prompts_prefilled_together_get_the_bits_of_their_prefill_alone(
    loaded: LoadedModel, weights: WeightLayout
) -> None:
    with torch.inference_mode():
        prompts = [ids_of(loaded, t) for t in PROMPTS]
        alone = SlotModel(loaded.model, max_positions=512, weights=weights, own_prefill=True)
        firsts = [alone.prefill(s, p) for s, p in enumerate(prompts)]
        together = SlotModel(loaded.model, max_positions=512, weights=weights, own_prefill=True)
        order = [3, 0, 6, 1]  # slots out of order, one past the first capacity of slots
        logits = together.prefill_many(order, prompts)
        for s, (slot, p) in enumerate(zip(order, prompts, strict=True)):
            assert torch.equal(logits[s], firsts[s]), f"prompt {s}"
            n = len(p)
            assert together.length(slot) == n
            layers = zip(together._kv.keys + together._kv.values, alone._kv.keys + alone._kv.values, strict=True)
            for mine, ref in layers:
                assert torch.equal(mine[slot, :, :n], ref[s, :, :n]), f"prompt {s}'s cache"
        # and they decode on as they would alone
        nexts = [int(torch.argmax(x)) for x in firsts]
        assert torch.equal(together.decode([order[1]], [nexts[1]])[0], alone.decode([1], [nexts[1]])[0])


def test_a_refused_prompt_among_many_changes_no_slot(loaded: LoadedModel) -> None:
    with torch.inference_mode():
        cache = SlotModel(loaded.model, max_positions=8, weights="packed", own_prefill=True)
        cache.prefill(0, torch.arange(3))
        with pytest.raises(ValueError, match="context holds 8"):
            cache.prefill_many([0, 1], [torch.arange(5), torch.arange(9)])
        assert cache.length(0) == 3
        with pytest.raises(KeyError):
            cache.length(1)


def test_fork_release_and_growth(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "INITIAL_CAPACITY", 8)
    monkeypatch.setattr(kv_cache, "INITIAL_SLOTS", 1)
    with torch.inference_mode():
        ids = ids_of(loaded, PROMPTS[0])
        ref, ref_logits = greedy(SlotModel(loaded.model, max_positions=512), 0, ids, 20)
        cache = SlotModel(loaded.model, max_positions=512)
        assert cache._kv.capacity == 8
        logits = cache.prefill(0, ids)
        cache.fork(0, 6)  # grows the slots
        assert cache.length(6) == len(ids)
        tokens = []
        for _ in range(20):  # grows the columns past 8, twice
            tokens.append(int(torch.argmax(logits)))
            logits = cache.decode([6], [tokens[-1]])[0]
        assert tokens == ref
        assert cache._kv.capacity >= len(ids) + 20 and cache._kv.slots >= 7
        cache.release(6)
        cache.release(6)  # nothing held: no error
        with pytest.raises(KeyError):
            cache.length(6)
        assert cache.length(0) == len(ids)


def test_the_context_limit_and_empty_prompts(loaded: LoadedModel) -> None:
    with torch.inference_mode():
        cache = SlotModel(loaded.model, max_positions=6)
        with pytest.raises(ValueError, match="no tokens"):
            cache.prefill(0, torch.tensor([], dtype=torch.long))
        with pytest.raises(ValueError, match="context holds 6"):
            cache.prefill(0, torch.arange(7))
        cache.prefill(0, torch.arange(5))
        cache.decode([0], [1])
        with pytest.raises(ValueError, match="full"):
            cache.decode([0], [1])


def test_models_the_forward_does_not_cover_fall_back() -> None:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    scaled = LlamaForCausalLM(config)
    assert not supported(scaled)
    assert isinstance(make_slots(scaled, 64), HFSlots)
    with pytest.raises(ValueError, match="does not cover"):
        SlotModel(scaled, max_positions=64)


@pytest.mark.parametrize("weights", ["bfloat16", "packed", "transposed"])
@pytest.mark.parametrize("part", ["mlp.down_proj", "self_attn.k_proj", "mlp.up_proj"])
def test_weight_copies_follow_weight_writes(loaded: LoadedModel, weights: WeightLayout, part: str) -> None:
    """A write to a weight alone or to one of a fused stack (query/key/value, gate/up) is seen at the next step."""
    weight = loaded.model.model.layers[0].get_submodule(part).weight
    kept = weight.detach().clone()
    ids = ids_of(loaded, PROMPTS[0])
    with torch.inference_mode():
        cache = SlotModel(loaded.model, max_positions=512, weights=weights)
        _, before = greedy(cache, 0, ids, 4)
    try:
        with torch.no_grad():
            weight.mul_(3.0)
        with torch.inference_mode():
            _, written = greedy(cache, 0, ids, 4)
            _, fresh = greedy(SlotModel(loaded.model, max_positions=512, weights=weights), 0, ids, 4)
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert not torch.allclose(before[1:], written[1:], atol=1e-4)
    assert torch.equal(written, fresh)


def test_a_replaced_weight_is_seen_at_the_next_step(loaded: LoadedModel) -> None:
    """A weight replaced by another tensor (a new Parameter, not a write into the old one) is seen at the next step;
    the check reads the modules' own dictionaries, and a module that keeps its weight elsewhere (a parametrization)
    is checked through its attributes instead, with the same result."""
    linear = loaded.model.model.layers[1].mlp.gate_proj
    kept = linear.weight
    ids = ids_of(loaded, PROMPTS[1])
    with torch.inference_mode():
        cache = SlotModel(loaded.model, max_positions=512, weights="transposed")
        _, before = greedy(cache, 0, ids, 4)
    copies = cache._copies
    try:
        linear.weight = torch.nn.Parameter(kept.detach() * 3.0, requires_grad=False)
        with torch.inference_mode():
            _, replaced = greedy(cache, 0, ids, 4)
            _, fresh = greedy(SlotModel(loaded.model, max_positions=512, weights="transposed"), 0, ids, 4)
        assert not torch.allclose(before[1:], replaced[1:], atol=1e-4)
        assert torch.equal(replaced, fresh)
        plain = copies._stamp()
        torch.nn.utils.parametrize.register_parametrization(linear, "weight", torch.nn.Identity())
        with pytest.raises(KeyError):
            slot_weights._layer_tensors(loaded.model.model.layers)
        assert copies._stamp() == plain  # through the attributes, which give the same tensors here
    finally:
        if torch.nn.utils.parametrize.is_parametrized(linear):
            torch.nn.utils.parametrize.remove_parametrizations(linear, "weight", leave_parametrized=False)
        linear.weight = kept
    assert copies._stamp() == [
        (id(t), t.data_ptr(), 0 if t.is_inference() else t._version) for t in copies._layer_attributes()
    ]


def test_a_failing_compiled_step_falls_back_to_eager(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken(forward: object, **kwargs: object) -> object:
        def run(*args: object) -> torch.Tensor:
            calls.append(len(args))
            raise RuntimeError("inductor failed")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    ids = ids_of(loaded, PROMPTS[2])
    with torch.inference_mode():
        want, want_logits = greedy(SlotModel(loaded.model, max_positions=512), 0, ids, 6)
        cache = SlotModel(loaded.model, max_positions=512, compile=True)
        assert cache._compiled is not None
        got, logits = greedy(cache, 0, ids, 6)
    assert calls == [9]  # tried once, then eager for good
    assert cache._compiled is None and "decoding eager" in caplog.text
    assert got == want and torch.equal(logits, want_logits)
