"""Incremental detokenization with text-level stop strings.

Each push decodes the whole output and emits the new suffix, minus what must be held back:

    tokens:  [..., 0xE2 0x82]        decoded: "price: \ufffd"   incomplete UTF-8 -> hold "\ufffd" back
    stop=["###"], decoded "a ##"     "##" may start a stop string -> emit "a ", hold "##"
    decoded "a ###b"                 stop found -> emit nothing more, finish "stop" (text = "a ")

So a client never sees a replacement character that later becomes a real one, nor the first
characters of a stop string. Decoding everything again is O(n) per push; with outputs capped at
a few thousand tokens this costs far less than one target forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        return self.decode(self.ids)

    def push(self, new_ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        """Add tokens; return (text safe to emit now, stop string reached)."""
        self.ids.extend(new_ids)
        text = self.decode(self.ids)
        cut = self._find_stop(text)
        if cut is not None:
            return self._emit(text, cut), True
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            end -= self._stop_prefix_len(text, end)
        return self._emit(text, end), False

    def tokens_through_stop(self, new: int) -> int:
        """After a push of `new` ids that hit a stop string: how many of them it took to complete it
        (the earlier ids held no stop string, or an earlier push would have stopped)."""
        base = len(self.ids) - new
        for m in range(1, new + 1):
            text = self.decode(self.ids[: base + m])
            if any(s in text for s in self.stop):
                return m
        return new

    def _emit(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent : end], end
        return out

    def _find_stop(self, text: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, self.sent - self._hold)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return max(min(hits), self.sent) if hits else None

    def _stop_prefix_len(self, text: str, end: int) -> int:
        """Length of the longest suffix of text[:end] (after what was sent) that begins some stop string."""
        for k in range(min(self._hold, end - self.sent), 0, -1):
            tail = text[end - k : end]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


@cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: token character -> byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def logprob_entry(token: str, logprob: float | None, raw: list[int] | None = None) -> dict:
    """A token's part of an OpenAI chat `logprobs.content` entry (bytes from its text unless given);
    an entry adds `top_logprobs`, a list of these."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()) if raw is None else raw}


class TokenStrings:
    """Token id -> (text, UTF-8 bytes) for logprobs entries. The text is the token decoded alone
    (special tokens included); the bytes are the token's own bytes, so a character split across
    tokens can be rebuilt from them (its text alone is U+FFFD), as in OpenAI's `bytes` field."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if self.byte_level:
                chars = _byte_level_chars()
                piece = self.tokenizer.convert_ids_to_tokens(token)
                if piece and all(c in chars for c in piece):
                    raw = bytes(chars[c] for c in piece)
            hit = self._cache[token] = (text, list(raw))
        return hit

    def entries(self, logprobs) -> list[dict]:
        """TokenLogprobs -> OpenAI chat `logprobs.content` entries."""
        return [
            {**self.entry(x.token, x.logprob), "top_logprobs": [self.entry(t, lp) for t, lp in x.top]} for x in logprobs
        ]

    def entry(self, token: int, logprob: float | None) -> dict:
        text, raw = self(token)
        return logprob_entry(text, logprob, raw)
