"""A suffix index over token documents: which tokens followed the longest match of a context's tail.

The documents are stored back to front in one flat array, so a context read backwards (last token
first) is a *prefix* of the suffixes it matches, and the suffixes sorted on their first `key_len`
tokens put every match of a context's last n tokens in one contiguous range. Extending the match
by one more (earlier) context token narrows that range with one binary search on a precomputed
column, so the longest match costs `key_len` searches, independent of corpus size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_SEP = -1  # between documents: never part of a match or a continuation


@dataclass(frozen=True)
class Match:
    length: int  # context tokens matched
    count: int  # places they occur in the corpus
    continuations: list[list[int]]  # tokens that followed (a sample of at most max_samples places)


class SuffixIndex:
    def __init__(self, docs: list[list[int]] | list[np.ndarray], key_len: int = 8):
        if key_len < 1:
            raise ValueError("key_len must be >= 1")
        self.key_len = key_len
        parts: list[np.ndarray] = []
        for d in docs:
            a = np.asarray(d, dtype=np.int64)
            if a.size:
                if a.ndim != 1 or (a < 0).any():
                    raise ValueError("documents must be 1-D sequences of non-negative token ids")
                parts += [a, np.array([_SEP])]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.num_tokens = int(flat.size - len(parts) // 2)
        self.num_docs = len(parts) // 2
        # forward layout (for continuations) and the reversed one (for matching)
        self._fwd = flat.astype(np.int32)
        rev = np.concatenate([flat[::-1], np.full(key_len, _SEP)]).astype(np.int32)
        n = flat.size
        starts = np.nonzero(rev[:n] != _SEP)[0]
        cols = [rev[starts + k] for k in range(key_len)]
        order = np.lexsort(cols[::-1])  # primary key: the first column
        self._sa = starts[order]
        self._cols = [c[order] for c in cols]  # column k: token k steps back from each match end

    def __len__(self) -> int:
        return self.num_tokens

    def longest_match(self, context: list[int], max_len: int | None = None, min_len: int = 1) -> tuple[int, int, int]:
        """(n, lo, hi): the longest n ≤ max_len such that context[-n:] occurs;
        its rows lo:hi (n = 0 if none ≥ min_len)."""
        max_len = min(max_len or self.key_len, self.key_len, len(context))
        lo, hi, best = 0, len(self._sa), (0, 0, 0)
        for k in range(max_len):
            col = self._cols[k][lo:hi]
            t = np.int32(context[-1 - k])
            new_lo = lo + int(np.searchsorted(col, t, "left"))
            new_hi = lo + int(np.searchsorted(col, t, "right"))
            if new_lo >= new_hi:
                break
            lo, hi = new_lo, new_hi
            if k + 1 >= min_len:
                best = (k + 1, lo, hi)
        return best

    def lookup(
        self, context: list[int], length: int, max_len: int | None = None, min_len: int = 1, max_samples: int = 64
    ) -> Match:
        """Continuations (up to `length` tokens) after the longest matching tail of `context`."""
        n, lo, hi = self.longest_match(context, max_len, min_len)
        if n == 0 or length <= 0:
            return Match(0, 0, [])
        rows = np.arange(lo, hi) if hi - lo <= max_samples else np.linspace(lo, hi - 1, max_samples).astype(np.int64)
        starts = self._fwd.size - self._sa[rows]  # forward position right after the matched tokens
        grid = np.minimum(starts[:, None] + np.arange(length), self._fwd.size - 1)
        conts = []
        for row in self._fwd[grid].tolist():
            cut = row.index(_SEP) if _SEP in row else len(row)
            if cut:
                conts.append(row[:cut])
        return Match(n, hi - lo, conts)
