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
