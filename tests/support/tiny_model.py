"""A tiny randomly initialised Llama with the real SmolLM2 tokenizer, for fast engine tests.

The weights are noise (outputs are gibberish) but deterministic (``torch.manual_seed(0)``); the tokenizer and its
ChatML chat template are SmolLM2's, taken from the embedded GGUF file through the loader's tokenizer cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from miserver.engines.local.loader import load_tokenizer, resolve_model_source
from miserver.settings import EMBEDDED_MODEL_ID


def default_cache_dir() -> Path:
    """``MISERVER_CACHE_DIR`` or ``~/.cache/miserver`` (the default of ``Settings.cache_dir``)."""
    return Path(os.environ.get("MISERVER_CACHE_DIR") or "~/.cache/miserver").expanduser()


def build_tiny_model(path: Path, cache_dir: Path | None = None) -> Path:
    """Save a 2-layer, 64-wide ``LlamaForCausalLM`` and the SmolLM2 tokenizer into ``path``; return ``path``.

    About a second once the tokenizer is cached under ``cache_dir`` (the first time reads it from the GGUF file,
    5-10 s). Raises ``ValueError`` when the embedded model's package is not installed.
    """
    tokenizer = load_tokenizer(resolve_model_source(EMBEDDED_MODEL_ID), cache_dir or default_cache_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
