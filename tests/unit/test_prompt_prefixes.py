"""Prompt prefixes reused across slots (``engines/local/prefixes.py`` and the slot forward's prefill over the attention
kernel), on the tiny random Llama (CPU).

A prompt that starts with tokens a slot's earlier prompt holds copies their keys and values and computes only the
rest, with the bits of a prefill of the whole prompt; records follow forks and refills, and die with a weight write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miserver.engines.adapter import generation_request
from miserver.engines.local.engine import LocalEngine
from miserver.engines.local.loader import LoadedModel, load_model, resolve_model_source
from miserver.engines.local.prefixes import SECOND_PASS_TOKENS, PromptPrefixes
from miserver.engines.local.slots import KVCacheKind, SlotModel

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never make anything up."
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Why is the sea salty?"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    with torch.inference_mode():
        yield load_model(resolve_model_source(str(tiny_model_dir), None), tmp_path_factory.mktemp("cache"), "cpu")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


def chat(loaded: LoadedModel, question: str) -> torch.Tensor:
    """The chat template's ids of ``SYSTEM`` and ``question``."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return torch.tensor(list(ids), dtype=torch.long)


def slots(loaded: LoadedModel, folder: Path, kv_cache: KVCacheKind = "bfloat16") -> SlotModel:
    cache = SlotModel(
        loaded.model,
        max_positions=512,
        weights="packed",
        own_prefill=True,
        attention="kernel",
        kv_cache=kv_cache,
        kernel_folder=folder,
    )
    assert cache.attention == "kernel"
    return cache


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    same = (a[:n] == b[:n]).tolist()
    return same.index(False) if False in same else n


def columns(cache: SlotModel, slot: int, n: int) -> list[torch.Tensor]:
    return [layer[slot, :, :n] for layer in (*cache._kv.keys, *cache._kv.values)]


def test_longest_finds_the_slot_sharing_most_and_leaves_the_last_token() -> None:
    prefixes = PromptPrefixes()
    prefixes.record(0, torch.tensor([1, 2, 3, 4]), 0)
    prefixes.record(1, torch.tensor([1, 2, 9]), 0)
    assert prefixes.longest(torch.tensor([1, 2, 3, 7, 8]), exclude=()) == (0, 3)
    assert prefixes.longest(torch.tensor([1, 2, 3, 7, 8]), exclude={0}) == (1, 2)
    assert prefixes.longest(torch.tensor([1, 2, 3, 4]), exclude=()) == (0, 3)  # the last position is computed
    assert prefixes.longest(torch.tensor([5, 6]), exclude=()) == (-1, 0)
    assert prefixes.computed == 7 and prefixes.reused == 0
    prefixes.copy(0, 2, 4)
    assert prefixes.longest(torch.tensor([1, 2, 3, 4, 5]), exclude={0}) == (2, 4)
    prefixes.copy(1, 2, 2)  # fewer columns than slot 1's prompt: slot 2 holds no prompt any more
    assert prefixes.longest(torch.tensor([1, 2, 3, 4, 5]), exclude={0, 1}) == (-1, 0)
    prefixes.forget()
    assert prefixes.longest(torch.tensor([1, 2, 3, 4, 5]), exclude=()) == (-1, 0)


@pytest.mark.parametrize("kv_cache", ["model", "bfloat16"])
def test_a_shared_prefix_is_copied_with_the_bits_of_a_whole_prefill(
    loaded: LoadedModel, kernel_dir: Path, kv_cache: KVCacheKind
) -> None:
    first, second = chat(loaded, QUESTIONS[0]), chat(loaded, QUESTIONS[1])
    common = shared_prefix(first, second)
    assert common > 10  # the system prompt and the template around it
    with torch.inference_mode():
        warm, cold = slots(loaded, kernel_dir, kv_cache), slots(loaded, kernel_dir, kv_cache)
        warm.prefill(0, first)
        logits = warm.prefill(1, second)
        assert (warm.prefixes.reused, warm.prefixes.computed) == (common, len(first) + len(second) - common)
        alone = cold.prefill(1, second)
        assert cold.prefixes.reused == 0
        assert torch.equal(logits, alone)
        for mine, ref in zip(columns(warm, 1, len(second)), columns(cold, 1, len(second)), strict=True):
            assert torch.equal(mine, ref)
        token = int(torch.argmax(alone))
        for _ in range(4):  # the steps after it too
            step, ref_step = warm.decode([1], [token]), cold.decode([1], [token])
            assert torch.equal(step, ref_step)
            token = int(torch.argmax(step))


def test_prompts_prefilled_together_reuse_what_other_slots_hold(loaded: LoadedModel, kernel_dir: Path) -> None:
    prompts = [chat(loaded, q) for q in QUESTIONS]
    with torch.inference_mode():
        warm, cold = slots(loaded, kernel_dir), slots(loaded, kernel_dir)
        warm.prefill(5, prompts[0])
        together = warm.prefill_many([0, 1, 2], prompts)
        expected = sum(min(shared_prefix(prompts[0], p), len(p) - 1) for p in prompts)
        assert warm.prefixes.reused == expected
        for slot, (ids, logits) in enumerate(zip(prompts, together, strict=True)):
            assert torch.equal(logits, cold.prefill(slot, ids))


def test_prompts_prefilled_together_share_a_prefix_no_slot_holds(loaded: LoadedModel, kernel_dir: Path) -> None:
    """Prompts of one prefill sharing a long prefix that no slot holds: the first computes it, the others wait for a
    second pass and copy it, each with the bits of its prefill alone (cache columns and logits)."""
    prompts = [chat(loaded, q) for q in QUESTIONS]
    common = [min(shared_prefix(prompts[0], p), len(p) - 1) for p in prompts[1:]]
    assert min(common) >= SECOND_PASS_TOKENS
    with torch.inference_mode():
        warm, cold = slots(loaded, kernel_dir), slots(loaded, kernel_dir)
        assert warm.prefixes.passes([0, 1, 2], prompts) == [[0], [1, 2]]
        together = warm.prefill_many([0, 1, 2], prompts)
        assert warm.prefixes.reused == sum(common)
        assert warm.prefixes.passes([3, 4], prompts[1:]) == [[0, 1]], "what the slots hold now needs no second pass"
        for slot, (ids, logits) in enumerate(zip(prompts, together, strict=True)):
            assert torch.equal(logits, cold.prefill(slot, ids))
            for mine, ref in zip(columns(warm, slot, len(ids)), columns(cold, slot, len(ids)), strict=True):
                assert torch.equal(mine, ref)
    short = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 5])]
    assert PromptPrefixes().passes([0, 1], short) == [[0, 1]], "a few shared tokens are not worth a second pass"


def test_a_slot_refilled_with_a_longer_prompt_keeps_its_own_columns(loaded: LoadedModel, kernel_dir: Path) -> None:
    """A later turn of a conversation, in the slot that held the earlier one."""
    earlier = chat(loaded, QUESTIONS[0])
    later = torch.cat([earlier, torch.tensor(loaded.tokenizer.encode(" Paris. And of Spain?"))])
    with torch.inference_mode():
        warm, cold = slots(loaded, kernel_dir), slots(loaded, kernel_dir)
        warm.prefill(3, earlier)
        warm.release(3)
        logits = warm.prefill(3, later)
        assert warm.prefixes.reused == len(earlier)
        assert torch.equal(logits, cold.prefill(3, later))
        # the same prompt again still computes its last position, for its logits
        assert torch.equal(warm.prefill(3, later), logits)
        assert warm.prefixes.reused == len(earlier) + len(later) - 1


def test_a_weight_write_drops_every_prompt_held(loaded: LoadedModel, kernel_dir: Path) -> None:
    ids = chat(loaded, QUESTIONS[2])
    weight = loaded.model.model.layers[0].self_attn.k_proj.weight
    kept = weight.detach().clone()
    with torch.inference_mode():
        warm = slots(loaded, kernel_dir)
        warm.prefill(0, ids)
    try:
        with torch.no_grad():
            weight.mul_(2.0)
        with torch.inference_mode():
            logits = warm.prefill(1, ids)
            assert warm.prefixes.reused == 0
            assert torch.equal(logits, slots(loaded, kernel_dir).prefill(1, ids))
    finally:
        with torch.no_grad():
            weight.copy_(kept)


def test_a_fork_holds_its_source_prompt(loaded: LoadedModel, kernel_dir: Path) -> None:
    first, second = chat(loaded, QUESTIONS[0]), chat(loaded, QUESTIONS[1])
    with torch.inference_mode():
        warm = slots(loaded, kernel_dir)
        warm.prefill(0, first)
        warm.fork(0, 1)
        warm.prefill(0, second)  # slot 0 now holds another prompt; slot 1 still holds the first
        before = warm.prefixes.reused
        warm.prefill(2, first)
        assert warm.prefixes.reused - before == len(first) - 1


def test_the_engine_forgets_the_prompts_after_work_on_the_model(tiny_model_dir: Path) -> None:
    """``LocalEngine.call`` runs weight writes and saves: the cache reuses nothing it held before one."""

    async def run() -> tuple[int, int, int]:
        engine = await LocalEngine.start(model=str(tiny_model_dir), served_model_name="tiny", device="cpu")
        try:
            cache = engine._steps.cache
            assert isinstance(cache, SlotModel)
            ids = torch.tensor(engine.tokenize_chat([{"role": "user", "content": QUESTIONS[0]}]))
            await engine._inference(lambda: cache.prefill(0, ids))
            held = cache.prefixes.longest(ids, ())[1]
            await engine.call(lambda _: None)
            return len(ids), held, cache.prefixes.longest(ids, ())[1]
        finally:
            await engine.close()

    n, held, after = asyncio.run(run())
    assert (held, after) == (n - 1, 0)


def test_the_engine_counts_prompt_tokens_computed_and_reused(tiny_model_dir: Path) -> None:
    """``LocalEngine.prompt_tokens`` (``miserver_engine_prompt_tokens`` on ``/metrics``): two chats with one system
    prompt, the second copying the first's columns."""

    async def run() -> tuple[dict[str, int], dict[str, int], int, int]:
        engine = await LocalEngine.start(model=str(tiny_model_dir), served_model_name="tiny", device="cpu")
        try:
            prompts = [
                engine.tokenize_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
                for q in QUESTIONS[:2]
            ]
            before = engine.prompt_tokens
            for ids in prompts:
                request = generation_request(
                    ids, max_tokens=2, temperature=0.0, top_p=None, stop=None, seed=0, logprobs=None, n=1
                )
                await engine.generate(request)
            # the engine's start prefilled the one-token prompt [pad_id]: the first chat may reuse it
            common = shared_prefix(torch.tensor(prompts[0]), torch.tensor(prompts[1]))
            common += int(prompts[0][0] == engine.pad_id)
            return before, engine.prompt_tokens, common, len(prompts[0]) + len(prompts[1])
        finally:
            await engine.close()

    before, after, common, total = asyncio.run(run())
    assert after["reused"] - before["reused"] == common
    assert after["computed"] - before["computed"] == total - common
