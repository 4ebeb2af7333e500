"""Adaptive speculation: per step, pick the tree shape (or no speculation) with the best measured
throughput for the current batch-size bucket.

Throughput of an option = the mean over its recent steps of each step's own tokens / seconds, per
(option, batch bucket). Each step's tokens and seconds belong together: a bucket spans batch sizes
(17-32 is one), and a window of step times from bs 32 against tokens from bs 20 would mis-rate an
option. A step slower than twice the recent median counts as twice the median (one step slowed by a
noisy neighbour must not make an option look slow for good: the losers are only re-measured now
and then); the mean over a window evens out acceptance, which is noisy step to step.
Speculation off is always an option, so at any batch size the engine converges to at least vanilla
speed. Untried options are tried a few times; the losers are re-tried now and then because
acceptance drifts with the content.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from sglang_ext.tree import TreeShape

from .metrics import batch_bucket


@dataclass
class _Stat:
    steps: deque = field(default_factory=lambda: deque(maxlen=32))  # recent (seconds, tokens) of one step each
    n: int = 0

    @property
    def median_seconds(self) -> float:
        return statistics.median(s for s, _ in self.steps) if self.steps else 0.0

    @property
    def rate(self) -> float:
        if not self.steps:
            return 0.0
        cap = 2 * statistics.median(s for s, _ in list(self.steps)[-9:])
        return statistics.fmean(t / max(min(s, cap), 1e-9) for s, t in self.steps)


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
    def __init__(self, shape: TreeShape, warmup: int = 3, retry_every: int = 32, max_retry_every: int = 512, far_behind: float = 0.8, explore_budget: float = 0.01, trust_after: int = 8, tree_margin: float = 0.03):
        self.options = shape_menu(shape)
        self._cheapest_first = sorted(range(len(self.options)), key=lambda i: 0 if self.options[i] is None else self.options[i].num_draft_tokens)
        self.warmup, self.retry_every, self.max_retry_every, self.far_behind = warmup, retry_every, max_retry_every, far_behind
        self.explore_budget = explore_budget  # share of step time re-measuring the losing options may cost, all together
        self.trust_after = trust_after  # steps of an option before 'far behind' may back off its re-measurement
        # a tree must beat 'off' by this fraction to be chosen: where they are within noise (large
        # batches), speculating risks a loss for no gain
        self.tree_margin = tree_margin
        self.stats: dict[tuple[int, str], _Stat] = {}
        self.steps: dict[str, int] = {}
        self.next_retry: dict[tuple[str, int], int] = {}  # (bucket, option) -> step of its next re-measurement
        self.retry_gap: dict[tuple[str, int], int] = {}
        self.retries = 0  # steps spent re-measuring a losing option

    def _stat(self, i: int, bucket: str) -> _Stat:
        return self.stats.setdefault((i, bucket), _Stat())

    def choose(self, batch_size: int) -> int:
        """Index into self.options for this step."""
        bucket = batch_bucket(batch_size)
        step = self.steps[bucket] = self.steps.get(bucket, 0) + 1
        known = self._nearest_measured(bucket)
        if known is None:  # nothing measured nearby: try every option a few times, cheapest first
            for i in self._cheapest_first:
                if self._stat(i, bucket).n < self.warmup:
                    return i
            known = bucket
        # a bucket the batch has just entered (requests finishing) starts from the nearest measured
        # one instead of exploring again: at a large batch an exploratory step is very slow
        rates = [self._rate(i, bucket, known) for i in range(len(self.options))]
        best = max(range(len(self.options)), key=lambda i: rates[i] / (1.0 if self.options[i] is None else 1.0 + self.tree_margin))
        # re-measure each losing option now and then (acceptance drifts with the content, and its
        # first measurements may have been unlucky); one far behind the best ever less often (each
        # re-measurement costs a slow step), one close to it at the base interval
        due = [i for i in range(len(self.options)) if i != best and step >= self.next_retry.setdefault((bucket, i), step + self.retry_every)]
        if not due:
            return best
        pick = min(due, key=lambda i: self.next_retry[(bucket, i)])
        gap = self.retry_gap.get((bucket, pick), self.retry_every)
        # NOTE: only once the option has a few steps: acceptance swings step to step, and a tree first
        # tried where the drafter had nothing to offer (the start of an answer) looked far behind
        far = rates[pick] < self.far_behind * rates[best] and self._stat(pick, bucket).n >= self.trust_after
        gap = min(2 * gap, self.max_retry_every) if far else self.retry_every
        self.retry_gap[(bucket, pick)] = gap
        # and never so often that re-measuring costs more than explore_budget of the time (shared by
        # the losing options): at a large batch one tree step (draft catch-up + a big verify) can cost
        # several plain steps (a budget per option let two losing trees cost twice the budget)
        extra = self._seconds(pick, bucket, known) / max(self._seconds(best, bucket, known), 1e-9) - 1.0
        losers = len(self.options) - 1
        self.next_retry[(bucket, pick)] = step + max(gap, math.ceil(extra * losers / self.explore_budget))
        self.retries += 1
        return pick

    def _measured(self, bucket: str) -> bool:
        return all(self._stat(i, bucket).n >= self.warmup for i in range(len(self.options)))

    def _nearest_measured(self, bucket: str) -> str | None:
        """This bucket, else a measured neighbour (half or double the batch), else None.
        NOTE: only a neighbour: from bs 16 to bs 64 the best tree changes (a verify step's cost grows
        with the batch), and a sweep that jumped 16 -> 64 paid for bs 16's big tree until bs 64's own
        measurements took over (0.89x vanilla in a 120-step run)."""
        if self._measured(bucket):
            return bucket
        def distance(b: str) -> float:
            return abs(math.log2(int(b)) - math.log2(int(bucket)))

        near = [b for b in {b for _, b in self.stats} if self._measured(b) and distance(b) <= 1]
        return min(near, key=distance, default=None)

    def _source(self, i: int, bucket: str, known: str) -> tuple[_Stat, float]:
        """Where option i's numbers come from: this bucket once it has a few steps of i, else the
        known bucket, whose rate is scaled by their batch sizes (rates are tokens/s of the batch)."""
        own = self._stat(i, bucket)
        if own.n >= self.warmup or known == bucket:
            return own, 1.0
        return self._stat(i, known), int(bucket) / int(known)

    def _seconds(self, i: int, bucket: str, known: str) -> float:
        return self._source(i, bucket, known)[0].median_seconds

    def _rate(self, i: int, bucket: str, known: str) -> float:
        st, scale = self._source(i, bucket, known)
        return st.rate * scale

    def observe(self, option: int, batch_size: int, seconds: float, tokens: int) -> None:
        s = self._stat(option, batch_bucket(batch_size))
        s.steps.append((seconds, tokens))
        s.n += 1
