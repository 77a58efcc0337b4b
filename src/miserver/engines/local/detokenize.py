"""Detokenising, incrementally: each token id's own bytes and text (:class:`TokenTexts`), a streaming decoder that
emits the text each token completes (:class:`TextStream`), and the output of one generated sequence that holds back
what could begin a stop string and groups tokens with the text they complete (:class:`_Output`).

Pure Python over the tokenizer (and the ``tokenizers`` library's ``DecodeStream`` when the tokenizer has a Rust
backend); runs on the engine's thread beside the generation loop.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from miserver.engines.base import FinishReason, StreamDelta, TokenLogprob


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def render_bytes(raw: bytes) -> str:
    """A token's text for logprobs: ``raw`` decoded as UTF-8 where valid, else OpenAI's ``bytes:\\xNN...`` form
    (every byte escaped, e.g. ``bytes:\\xe3\\x81``)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenTexts:
    """Each token id's own bytes and text, from the tokenizer's vocabulary (memoised; one per tokenizer).

    A byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM2, Qwen: the tokenizer's decoder is ``ByteLevel``) spells
    each byte with one printable character; the token's bytes are its vocabulary string mapped back through that
    alphabet, so a token holding part of a multi-byte character gets exactly its bytes (never U+FFFD). Added tokens
    (special ones included) are their content in UTF-8; a SentencePiece byte-fallback token ``<0xNN>`` is the byte
    NN; any other token is its vocabulary string with ``▁`` read as a space.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        decoder = backend.decoder if isinstance(backend, tokenizers.Tokenizer) else None
        self.byte_level = isinstance(decoder, tokenizers.decoders.ByteLevel) or (
            decoder is not None and "ByteLevel" in str(decoder)
        )
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added = {int(i): str(t) for i, t in added.items()}
        #: ids the text skips (``skip_special_tokens``: added tokens marked special, as the decoder skips them)
        special = [int(i) for i, t in added.items() if getattr(t, "special", False)]
        self.special = frozenset(special if added else (int(i) for i in tokenizer.all_special_ids))
        self._raw: dict[int, bytes] = {}
        self._token: dict[int, str] = {}

    def raw(self, token_id: int) -> bytes:
        """The token's own UTF-8 bytes from the vocabulary (see the class)."""
        found = self._raw.get(token_id)
        if found is None:
            found = self._raw[token_id] = self._compute_raw(token_id)
        return found

    def token(self, token_id: int) -> str:
        """The token's text for logprobs: :func:`render_bytes` of :meth:`raw`."""
        found = self._token.get(token_id)
        if found is None:
            found = self._token[token_id] = render_bytes(self.raw(token_id))
        return found

    def returned(self, token_id: int) -> bytes:
        """The bytes the token adds to returned text: :meth:`raw`, or nothing for a special token (skipped)."""
        return b"" if token_id in self.special else self.raw(token_id)

    def _compute_raw(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return str(self.tokenizer.decode([token_id])).encode("utf-8")
        if self.byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


_TEXTS: dict[int, tuple[PreTrainedTokenizerBase, TokenTexts]] = {}


def token_texts(tokenizer: PreTrainedTokenizerBase) -> TokenTexts:
    """The :class:`TokenTexts` of ``tokenizer`` (one shared instance per tokenizer object)."""
    entry = _TEXTS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        if len(_TEXTS) > 16:
            _TEXTS.clear()
        entry = _TEXTS[id(tokenizer)] = (tokenizer, TokenTexts(tokenizer))
    return entry[1]


class TextStream:
    """Incremental detokenisation of one token sequence (special tokens skipped), O(1) work per token.

    Uses the tokenizers library's own streaming decoder (``tokenizers.decoders.DecodeStream``) when the tokenizer
    has a Rust backend, else the same algorithm in Python over ``tokenizer.decode`` (decode a short window of ids
    before and after the new token and emit the difference). :meth:`step` returns the text a token completes, or
    None while the text would end inside a multi-byte character (or the token adds no text: a special token).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        self._rust: tuple[DecodeStream, tokenizers.Tokenizer] | None = None
        if isinstance(backend, tokenizers.Tokenizer):
            self._rust = (DecodeStream(skip_special_tokens=True), backend)
        self.ids: list[int] = []
        self.emitted: list[str] = []
        self.waiting = False  # tokens after the last emitted text
        self._prefix = self._read = 0  # the Python fallback's window

    def step(self, token: int) -> str | None:
        """Feed the next token id; the new text, or None (see the class)."""
        self.ids.append(token)
        chunk = self._rust[0].step(self._rust[1], token) if self._rust is not None else self._python_step()
        self.waiting = chunk is None
        if chunk is not None:
            self.emitted.append(chunk)
        return chunk

    def rest(self) -> str:
        """The text of the tokens fed since the last emitted text (an incomplete character decodes as U+FFFD; ""
        for special tokens). One full decode of the sequence, so call it once, at the end."""
        if not self.waiting:
            return ""
        full = str(self.tokenizer.decode(self.ids, skip_special_tokens=True))
        done = "".join(self.emitted)
        self.waiting = False
        return full[len(done) :] if full.startswith(done) else ""

    def _python_step(self) -> str | None:
        decode = self.tokenizer.decode
        before = str(decode(self.ids[self._prefix : self._read], skip_special_tokens=True))
        after = str(decode(self.ids[self._prefix :], skip_special_tokens=True))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return None


def text_pieces(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """The piece of text each of ``ids`` completes (see :attr:`TokenLogprob.text`); they join to
    ``tokenizer.decode(ids, skip_special_tokens=True)``, the last token taking any incomplete tail."""
    stream = TextStream(tokenizer)
    pieces = [stream.step(int(t)) or "" for t in ids]
    if pieces:
        pieces[-1] += stream.rest()
    return pieces


class _Output:
    """Detokenises one sequence incrementally and decides what text may be emitted.

    Text comes from a :class:`TextStream` (nothing while a multi-byte character is split across tokens); the
    longest suffix that could still begin a stop string is held back. A token's ids/logprobs are emitted with the
    delta that completes its text; tokens whose text is completed by the same chunk form a group
    (``starts``/``ends``: offsets in ``text`` of the group's text), the last token of a group taking its text.
    ``generated`` counts every token sampled (an end-of-sequence token included, see :meth:`end_token`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], index: int) -> None:
        self.tokenizer = tokenizer
        self.texts = token_texts(tokenizer)
        self.stream = TextStream(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.index = index
        self.ids: list[int] = []
        self.starts: list[int | None] = []
        self.ends: list[int | None] = []  # offset in ``text`` where each token's text is complete
        self.logprobs: list[TokenLogprob | None] = []
        self.text = ""
        self.resolved = 0  # tokens whose group is known
        self.sent_text = 0
        self.sent_tokens = 0
        self.sent_bytes = 0
        self.generated = 0
        self.reported = 0
        self.stop_at: int | None = None

    def add(self, token: int, logprob: TokenLogprob | None) -> None:
        """Append a generated token; sets ``stop_at`` when a stop string is now complete."""
        self.ids.append(token)
        self.starts.append(None)
        self.ends.append(None)
        self.logprobs.append(logprob)
        self.generated += 1
        chunk = self.stream.step(token)
        if chunk is None:
            return  # wait for the rest of the character
        self._resolve(chunk)
        # No stop can start inside text already sent: it would have been held back.
        found = [p for p in (self.text.find(s, self.sent_text) for s in self.stop) if p >= 0]
        if found:
            self.stop_at = min(found)

    def end_token(self) -> None:
        """Count an end-of-sequence token: generated, but neither text nor a token of the sequence."""
        self.generated += 1

    def pending(self) -> StreamDelta | None:
        """The delta that can be sent now without risking text of a stop string, or None."""
        upto = len(self.text)
        longest = max((len(s) for s in self.stop), default=0)
        for j in range(max(self.sent_text, len(self.text) - longest + 1), len(self.text)):
            tail = self.text[j:]
            if any(s.startswith(tail) for s in self.stop):
                upto = j
                break
        return self._delta(upto, None)

    def finish(self, reason: FinishReason) -> StreamDelta:
        """The sequence's last delta: everything left, or everything before the stop string (with the token that
        the stop string cuts)."""
        if self.stop_at is not None:
            delta = self._delta(self.stop_at, reason, cut=True)
        else:
            if self.resolved < len(self.ids):
                self._resolve(self.stream.rest())  # an incomplete character at the end, or special tokens
            delta = self._delta(len(self.text), reason)
        last = delta or StreamDelta(self.index, "", finish_reason=reason, generated_tokens=self._unreported())
        if self.stop_at is None:
            return last
        matched = next(s for s in self.stop if self.text.startswith(s, self.stop_at))
        return dataclasses.replace(last, stop_sequence=matched)

    def _resolve(self, chunk: str) -> None:
        start = len(self.text)
        self.text += chunk
        for k in range(self.resolved, len(self.ids)):
            self.starts[k] = start
            self.ends[k] = len(self.text)
        self.resolved = len(self.ids)

    def _unreported(self) -> int:
        n, self.reported = self.generated - self.reported, self.generated
        return n

    def _delta(self, upto: int, reason: FinishReason | None, cut: bool = False) -> StreamDelta | None:
        text = self.text[self.sent_text : upto] if upto > self.sent_text else ""
        first = n = self.sent_tokens
        while n < self.resolved:
            start, end = self.starts[n], self.ends[n]
            assert start is not None and end is not None
            if not (end <= upto or (cut and start < upto)):
                break
            n += 1
        if not text and n == first and reason is None:
            return None
        self.sent_text = max(self.sent_text, upto)
        self.sent_tokens = n
        budget = len(self.text[:upto].encode("utf-8")) - self.sent_bytes if cut else None
        lps = []
        for k in range(first, n):
            own = self.texts.returned(self.ids[k])
            whole = len(own)
            if budget is not None:
                own, budget = own[: max(budget, 0)], budget - whole
            self.sent_bytes += len(own)
            lp = self.logprobs[k]
            if lp is None:
                continue
            last_of_group = k + 1 >= self.resolved or self.starts[k + 1] != self.starts[k]
            start, end = self.starts[k], self.ends[k]
            assert start is not None and end is not None
            piece = self.text[start : min(end, upto)] if last_of_group else ""
            token = render_bytes(own) if len(own) < whole else lp.token  # a stop string cut it
            lps.append(dataclasses.replace(lp, token=token, token_bytes=own, text=piece))
        generated = self._unreported()
        return StreamDelta(self.index, text, tuple(self.ids[first:n]), tuple(lps), reason, generated)
