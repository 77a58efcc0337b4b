"""Detokenisation cost of one generated row: the streaming decoder against a full decode at every token.

Generates ``--tokens`` tokens (default 512) for one chat row with the engine's own generation loop
(``generate.generate_sequence``; the end-of-sequence token is ignored so the row has exactly that length, sampled at
temperature 1 with a fixed seed) and measures, in the same run:

- ``after``: the seconds spent in the incremental detokeniser the engine uses (``detokenize.TextStream``: the
  tokenizers library's ``DecodeStream``, one step per token, plus the one final decode when a character is left
  incomplete), timed around each call during the generation;
- ``before``: the seconds the previous algorithm spends on the same token ids: ``tokenizer.decode`` of the whole id
  list at every token (what ``_Output`` did until this change), timed after the generation;
- ``after_alone``: the streaming decoder over the same ids again, outside generation (``before``'s conditions);
- the row's wall time, and each decoding time as a share of the row (``before`` as a share of the row it would have
  made: the row less ``after`` plus ``before``).

With ``--no-generate`` no model runs: the ids are the tokens of an English and Japanese text repeated to
``--tokens`` tokens, and only the two decoders are timed (``before`` against ``after_alone``).

    python bench/detokenize.py                       # the embedded SmolLM2 on this machine's CPU
    python bench/detokenize.py --tokens 2000 --no-generate

The model's context must hold the prompt and the tokens (the embedded SmolLM2: 8,192 positions).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miserver.engines.base import SamplingParams
from miserver.engines.local import detokenize, generate
from miserver.engines.local.loader import load_model, load_tokenizer, resolve_model_source
from miserver.settings import EMBEDDED_MODEL_ID

PROMPT = [{"role": "user", "content": "Write a long story about a cat who travels around the world."}]


def timed(spent: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its wall time added to ``spent[0]`` at each call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    return wrapper


def decode_before(tokenizer: Any, ids: list[int]) -> float:
    """Seconds of the previous algorithm (``_Output.add`` until this change): the whole list at every token."""
    start = time.perf_counter()
    for k in range(1, len(ids) + 1):
        str(tokenizer.decode(ids[:k], skip_special_tokens=True)).endswith("\ufffd")
    return time.perf_counter() - start


def decode_after(tokenizer: Any, ids: list[int]) -> float:
    """Seconds of the streaming decoder the engine uses now, over the same ids."""
    start = time.perf_counter()
    stream = detokenize.TextStream(tokenizer)
    for token in ids:
        stream.step(token)
    stream.rest()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_ID, help="model id or folder (default: the embedded one)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/miserver").expanduser())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-generate", action="store_true", help="time the decoders on text ids, run no model")
    args = parser.parse_args()

    if args.no_generate:
        tokenizer = load_tokenizer(resolve_model_source(args.model), args.cache_dir)
        text = "The cat walked to the station and said ありがとう to everyone, then slept. "
        text_ids: list[int] = (tokenizer(text, add_special_tokens=False)["input_ids"] * args.tokens)[: args.tokens]
        before, after_alone = decode_before(tokenizer, text_ids), decode_after(tokenizer, text_ids)
        result = {"model": args.model, "tokens": len(text_ids), "decode_seconds_before": round(before, 3)}
        result |= {"decode_seconds_after_alone": round(after_alone, 4), "speedup": round(before / after_alone, 1)}
        print(json.dumps(result, indent=2))
        return
    loaded = load_model(resolve_model_source(args.model), args.cache_dir, args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    encoded: Any = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = [int(i) for i in (encoded if isinstance(encoded, list) else encoded["input_ids"])]
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0)

    spent = [0.0]
    original_step, original_rest = detokenize.TextStream.step, detokenize.TextStream.rest
    detokenize.TextStream.step = timed(spent, original_step)  # type: ignore[method-assign]
    detokenize.TextStream.rest = timed(spent, original_rest)  # type: ignore[method-assign]
    ids: list[int] = []
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            for delta in generate.generate_sequence(model, tokenizer, prompt, params, eos_ids=()):
                ids.extend(delta.token_ids)
            row = time.perf_counter() - start
    finally:
        detokenize.TextStream.step, detokenize.TextStream.rest = original_step, original_rest  # type: ignore[method-assign]
    after = spent[0]
    assert len(ids) == args.tokens, f"generated {len(ids)} tokens"

    before, after_alone = decode_before(tokenizer, ids), decode_after(tokenizer, ids)

    result = {
        "model": args.model,
        "device": args.device,
        "tokens": len(ids),
        "row_seconds": round(row, 3),
        "decode_seconds_after": round(after, 4),
        "decode_seconds_before": round(before, 3),
        "decode_seconds_after_alone": round(after_alone, 4),
        "share_of_row_after": round(after / row, 5),
        "share_of_row_before": round(before / (row - after + before), 4),
        "speedup": round(before / after_alone, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
