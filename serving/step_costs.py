"""What the adaptive policy (serving/adaptive.py) measures: an option's recent steps in a batch bucket (RateWindow),
its acceptance, tree size and drafting seconds per request at any batch size (PerRequestWindow), and the verify
step's cost as a function of its rows (StepCostModel)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RateWindow:
    steps: deque = field(default_factory=lambda: deque(maxlen=32))  # recent (seconds, tokens) of one step each
    n: int = 0
    _cache: tuple | None = None  # (median seconds, rate) until the next step

    def add(self, seconds: float, tokens: float) -> None:
        self.steps.append((seconds, tokens))
        self.n += 1
        self._cache = None

    def _cap(self) -> float:
        """The most seconds one step counts for: twice the recent median."""
        return 2 * statistics.median(s for s, _ in list(self.steps)[-9:])

    def step_rate(self, seconds: float, tokens: float) -> float:
        """One step's tokens/s, its time capped as this option's steps are (the cap of an empty window is none)."""
        return tokens / max(min(seconds, self._cap()) if self.steps else seconds, 1e-9)

    def _stats(self) -> tuple[float, float]:
        if self._cache is None:
            if not self.steps:
                return 0.0, 0.0
            cap = self._cap()
            self._cache = (
                statistics.median(s for s, _ in self.steps),
                statistics.fmean(t / max(min(s, cap), 1e-9) for s, t in self.steps),
            )
        return self._cache

    @property
    def median_seconds(self) -> float:
        return self._stats()[0]

    @property
    def rate(self) -> float:
        return self._stats()[1]


class PerRequestWindow:
    """Running sums over an option's recent steps (any batch size): rows, tokens and drafting seconds per request.
    The last `window` steps, of which only those of the last `horizon` policy steps (at least `keep`): an option
    that is not chosen runs only at re-measurements, far apart, and its acceptance then is the content's now;
    a window of samples alone would mix it with what it saw thousands of steps before (a stretch of content it
    drafted badly kept it off long after)."""

    def __init__(self, window: int = 64, horizon: int = 64, keep: int = 8):
        # (batch, rows, tokens, draft seconds, the policy's step count when it was observed)
        self.steps: deque = deque(maxlen=window)
        self.horizon, self.keep = horizon, keep
        self._sums = [0.0, 0.0, 0.0, 0.0]

    def add(self, now: int, batch: int, rows: float, tokens: float, draft_seconds: float = 0.0) -> None:
        while self.steps and (
            len(self.steps) == self.steps.maxlen
            or (len(self.steps) >= self.keep and now - self.steps[0][4] >= self.horizon)
        ):
            for j, v in enumerate(self.steps.popleft()[:4]):
                self._sums[j] -= v
        self.steps.append((batch, rows, tokens, draft_seconds, now))
        for j, v in enumerate((batch, rows, tokens, draft_seconds)):
            self._sums[j] += v

    @property
    def rows(self) -> float:
        return self._sums[1] / self._sums[0]

    @property
    def tokens(self) -> float:
        return self._sums[2] / self._sums[0]

    @property
    def draft_seconds(self) -> float:
        return self._sums[3] / self._sums[0]


class StepCostModel:
    """Seconds of one engine step's verify as a function of its rows (requests + draft nodes), from the
    measured steps of every option and batch size. A step costs about the same while reading the
    weights dominates (few rows) and grows with the rows once compute does, so the cost is interpolated
    between measured row counts and extended past the largest along the slope from the point at half
    its rows (or fewer): a long baseline. NOTE: the slope between the last two bins (25 % apart, each
    a median of noisy steps) could be near flat and made trees look cheap at untried batch sizes,
    paying for a slow trial step (at bs 64 several plain steps) each time. A bin keeps the steps of the last
    `horizon` (at least `keep`): a step's cost follows the context (a long prompt's steps cost 1.5x), and the
    bins of an option kept off, filled at re-measurements far apart, held another content's cost against the
    off bin's current one."""

    def __init__(
        self, bin_ratio: float = 1.25, window: int = 16, min_samples: int = 3, horizon: int = 64, keep: int = 8
    ):
        self.log_ratio, self.window, self.min_samples = math.log(bin_ratio), window, min_samples
        self.horizon, self.keep = horizon, keep
        self.bins: dict[int, deque] = {}
        self.n = 0  # steps added: the bins' time
        self._points: list[tuple[float, float]] | None = None
        self._medians: dict[int, tuple[float, float]] = {}  # bin -> its (rows, seconds) medians, until it changes

    def add(self, rows: int, seconds: float) -> None:
        self.n += 1
        b = round(math.log(max(rows, 1)) / self.log_ratio)
        d = self.bins.get(b)
        if d is None:
            d = self.bins[b] = deque(maxlen=self.window)
        while len(d) >= self.keep and self.n - d[0][2] >= self.horizon:
            d.popleft()
        d.append((rows, seconds, self.n))
        self._medians.pop(b, None)
        self._points = None

    def points(self) -> list[tuple[float, float]]:
        """(rows, seconds) medians of the bins with enough steps, by rows (cached until the next step; a bin's
        medians until it changes: the policy asks every step, and a step changes one bin)."""
        if self._points is None:
            pts = []
            for b, d in self.bins.items():
                if len(d) >= self.min_samples:
                    m = self._medians.get(b)
                    if m is None:
                        m = self._medians[b] = (
                            statistics.median(r for r, _, _ in d),
                            statistics.median(s for _, s, _ in d),
                        )
                    pts.append(m)
            self._points = sorted(pts)
        return self._points

    def predict(self, rows: float) -> float | None:
        """Predicted seconds of a step with this many rows; None when nothing measured brackets it
        (past the largest measured row count with fewer than two points: no slope to follow)."""
        pts = self.points()
        if not pts:
            return None
        if rows <= pts[0][0]:
            return pts[0][1]  # fewer rows never cost more (a flat floor, not an extrapolated dip)
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        if len(pts) < 2:
            return None  # no slope to follow
        r1, s1 = pts[-1]
        r0, s0 = max((p for p in pts[:-1] if p[0] <= r1 / 2), default=pts[0])
        return s1 + max(s1 - s0, 0.0) / (r1 - r0) * (rows - r1)
