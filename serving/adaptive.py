"""Adaptive speculation: per step, pick the tree shape (or no speculation) with the best measured
throughput for the current batch-size bucket.

Throughput of an option = tokens emitted per step / seconds per (draft + verify) step, per
(option, batch bucket). Step time is the median of the last few steps (one step slowed by a noisy
neighbour must not make an option look slow for good: the losers are only re-measured now and
then); tokens per step is the mean over a longer window (acceptance is noisy step to step).
Speculation off is always an option, so at any batch size the engine converges to at least vanilla
speed. Untried options are tried a few times; the losers are re-tried now and then because
acceptance drifts with the content.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from sglang_ext.tree import TreeShape

from .metrics import batch_bucket


@dataclass
class _Stat:
    seconds: deque = field(default_factory=lambda: deque(maxlen=9))  # recent step times
    tokens: deque = field(default_factory=lambda: deque(maxlen=32))  # recent tokens per step
    n: int = 0

    @property
    def rate(self) -> float:
        if not self.seconds:
            return 0.0
        sec = statistics.median(self.seconds)
        return statistics.fmean(self.tokens) / sec if sec > 0 else 0.0


def shape_menu(shape: TreeShape) -> list[TreeShape | None]:
    """Off, the configured shape, and a smaller one (cheaper verify at large batch sizes)."""
    small_k = max(1, shape.topk // 2)
    small_d = max(1, shape.depth // 2)
    most = small_d + 1 if small_k == 1 else 1 + small_k + (small_d - 1) * small_k**2
    small = TreeShape(small_d, small_k, max(2, min(most, shape.num_draft_tokens // 2)))
    menu: list[TreeShape | None] = [None, shape]
    if small != shape:
        menu.append(small)
    return menu


class AdaptiveSpeculation:
    def __init__(self, shape: TreeShape, warmup: int = 3, retry_every: int = 32, max_retry_every: int = 512, far_behind: float = 0.8):
        self.options = shape_menu(shape)
        self.warmup, self.retry_every, self.max_retry_every, self.far_behind = warmup, retry_every, max_retry_every, far_behind
        self.stats: dict[tuple[int, str], _Stat] = {}
        self.steps: dict[str, int] = {}
        self.next_retry: dict[str, int] = {}
        self.retry_gap: dict[str, int] = {}
        self.retries = 0  # steps spent re-measuring a losing option

    def _stat(self, i: int, bucket: str) -> _Stat:
        return self.stats.setdefault((i, bucket), _Stat())

    def choose(self, batch_size: int) -> int:
        """Index into self.options for this step."""
        bucket = batch_bucket(batch_size)
        step = self.steps[bucket] = self.steps.get(bucket, 0) + 1
        for i in range(len(self.options)):
            if self._stat(i, bucket).n < self.warmup:
                return i
        rates = [self._stat(i, bucket).rate for i in range(len(self.options))]
        best = max(range(len(self.options)), key=rates.__getitem__)
        if step < self.next_retry.setdefault(bucket, step + self.retry_every):
            return best
        # re-measure a loser now and then (acceptance drifts with the content); one far behind
        # the best is re-measured ever less often (each retry costs a slow step)
        others = [i for i in range(len(self.options)) if i != best]
        pick = others[(step // self.retry_every) % len(others)]
        gap = self.retry_gap.get(bucket, self.retry_every)
        gap = min(2 * gap, self.max_retry_every) if rates[pick] < self.far_behind * rates[best] else self.retry_every
        self.retry_gap[bucket], self.next_retry[bucket] = gap, step + gap
        self.retries += 1
        return pick

    def observe(self, option: int, batch_size: int, seconds: float, tokens: int) -> None:
        s = self._stat(option, batch_bucket(batch_size))
        s.seconds.append(seconds)
        s.tokens.append(tokens)
        s.n += 1
