"""Adaptive speculation: per step, pick the tree shape (or no speculation) with the best throughput
at the current batch size: predicted by a model once every option has one (second paragraph), measured
per batch-size bucket before that (this paragraph).

Measured throughput of an option = the mean over its recent steps of each step's own tokens / seconds, per
(option, batch bucket). Each step's tokens and seconds belong together: a bucket spans batch sizes
(17-32 is one), and a window of step times from bs 32 against tokens from bs 20 would mis-rate an
option. A step slower than twice the recent median counts as twice the median (one step slowed by a
noisy neighbour must not make an option look slow for good: the losers are only re-measured now
and then); the mean over a window evens out acceptance, which is noisy step to step. An option that
is not the current best is rated by the ratios of its steps to the best's rate at the time (its own
window spans a long stretch over which the machine and the batch drift; the best's is recent).
Speculation off is always an option, so at any batch size the engine converges to at least vanilla
speed. Untried options are tried a few times; the losers are re-tried now and then because
acceptance drifts with the content.

Trying a tree is not free: at bs 64 on a CPU a 6-node tree step costs ~4 plain steps. So before paying
for a trial, a prior predicts the option's rate from what was measured elsewhere: its acceptance,
tree size and drafting seconds (per request, from any batch size) and a verify-cost model (seconds
of the verify forward as a function of its rows, from every step). 'Off' needs no acceptance: one
row and one token per request. Once every option has such a prior at this batch size, the choice is
made by the priors alone: they rest on many steps of every batch size, where a bucket's
own windows rest on single re-measurement steps whose acceptance swings with the content (enough to flip
the choice to a slower tree). A chain
that runs also rates the shorter chains nested in it (their drafts are its first nodes), so their
acceptance stays current without running them. An option the prior puts far behind is re-measured
only rarely, within the exploration budget.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from sglang_ext.tree import TreeShape

from .metrics import batch_bucket
from .step_costs import PerRequestWindow, RateWindow, StepCostModel

CONFIDENT_MIN_PROB = 0.3  # the confident option's cut: a lookup node needs a 1-token own match and all the evidence
CONFIDENT_FROM_BATCH = 4  # the engine offers the confident option from this many requests on


def shape_menu(shape: TreeShape, confident: bool = False) -> list[TreeShape | None]:
    """Off, the configured shape, and a smaller one (cheaper verify at large batch sizes); with
    `confident`, also the smaller one cut at CONFIDENT_MIN_PROB (fewer rows, each likelier accepted:
    where a verify row costs nearly what a token is worth)."""
    small_k = max(1, shape.topk // 2)
    small_d = max(1, shape.depth // 2)
    most = small_d + 1 if small_k == 1 else 1 + small_k + (small_d - 1) * small_k**2
    small = TreeShape(small_d, small_k, max(2, min(most, shape.num_draft_tokens // 2)), shape.min_prob)
    menu: list[TreeShape | None] = [None, shape]
    if small != shape:
        menu.append(small)
    if confident and small.min_prob < CONFIDENT_MIN_PROB:
        menu.append(TreeShape(small.depth, small.topk, small.num_draft_tokens, CONFIDENT_MIN_PROB))
    return menu


def member_arms(shape: TreeShape, members: tuple[str, ...] = ()) -> list[TreeShape]:
    """A merged drafter's members (drafters/merged.py), each alone at the configured shape: one arm
    each beside the merge's own shapes, so the policy measures whether the merge pays over its best
    member (the merge drafts with every member and verifies more rows). None for a single drafter."""
    if len(members) < 2:
        return []
    from sglang_ext.drafters.merged import MemberShape

    return [
        MemberShape(shape.depth, shape.topk, shape.num_draft_tokens, shape.min_prob, members=(i,))
        for i in range(len(members))
    ]


class AdaptiveSpeculation:
    REL_WINDOW = 16  # ratios kept per losing option (and bucket)

    def __init__(
        self,
        shape: TreeShape,
        warmup: int = 3,
        retry_every: int = 32,
        max_retry_every: int = 128,
        far_behind: float = 0.8,
        explore_budget: float = 0.01,
        trust_after: int = 8,
        tree_margin: float = 0.03,
        confident_from: int | None = None,
        members: tuple[str, ...] = (),
        catch_up: bool = False,
        burst: int = 8,
        recheck: int = 8,
        defer: bool = False,
        max_backoff: int = 2,
    ):
        self.options = shape_menu(shape, confident=confident_from is not None)
        # the confident (cut) option only from `confident_from` requests: at bs 1 a verify row costs a
        # tenth of a step and the cut's lost tokens cost more than its saved rows
        self.min_batch = [1] * len(self.options)
        if len(self.options) > len(shape_menu(shape)):
            self.min_batch[-1] = confident_from
        arms = member_arms(shape, members)  # a merged drafter: each member alone is an arm too
        self.options += arms
        self.min_batch += [1] * len(arms)
        self._cheapest_first = sorted(
            range(len(self.options)),
            key=lambda i: (
                (0, 0) if self.options[i] is None else (self.options[i].num_draft_tokens, -self.options[i].min_prob)
            ),
        )
        self.warmup, self.retry_every, self.max_retry_every, self.far_behind = (
            warmup,
            retry_every,
            max_retry_every,
            far_behind,
        )
        self.explore_budget = (
            explore_budget  # share of throughput re-measuring the losing options may cost, all together
        )
        self.trust_after = trust_after  # steps of an option before 'far behind' may back off its re-measurement
        # a tree must beat 'off' by this fraction to be chosen: where they are within noise (large
        # batches), speculating risks a loss for no gain
        self.tree_margin = tree_margin
        self._stats: dict[tuple[int, str], RateWindow] = {}
        self.steps: dict[str, int] = {}
        self.next_retry: dict[tuple[str, int], int] = {}  # (bucket, option) -> step of its next re-measurement
        self.retry_gap: dict[tuple[str, int], int] = {}
        self.retries = 0  # steps spent re-measuring a losing option
        self.cost = StepCostModel()
        # per option, its recent steps at any batch size -> acceptance and tree size per request
        self._history = [PerRequestWindow() for _ in self.options]
        self.clock = 0  # steps observed, any bucket: the history's time
        self.postponed = 0  # re-measurements skipped because the prior put the option far behind
        # (bucket, option) -> its re-measurements in a row slower than the best: each halves its share of the
        # exploration budget, to 1 / 2**max_backoff of it (acceptance drifts, but a tree that lost its last
        # re-measurements is unlikely to win the next; at bs 1 on a CPU where a drafter never pays, re-measuring it at
        # the full budget cost ~1 % of the throughput for good); one as fast as the best starts over (_came_close)
        self.lost: dict[tuple[str, int], int] = {}
        self.max_backoff = max_backoff
        # per bucket, the option chosen as best at the last step: the other options are rated against
        # its rate at the time they ran (rel), not by their own windows, which span long stretches
        self.best: dict[str, int] = {}
        self.rel: dict[tuple[int, str], deque] = {}  # (option, bucket) -> its last steps' rate / best's rate then
        # catch_up: the first drafted step after steps without drafting pays the drafter's catch-up on the tokens it
        # did not see (EAGLE-3 extends over all of them, MoA's memory over its last commits'): that step is not rated
        # (its cost is the switch's, not the option's), and a re-measurement that starts drafting runs one step
        # more, the ones rated: `burst` of them (the catch-up is the re-measurement's fixed cost; at bs 1 a rated step
        # of a tree slightly behind off costs a few % of a step, and one step's acceptance is 1 or 2 tokens: a
        # decision on one such sample flips with the luck of that step). Off: every step rated as it comes (a
        # drafter with nothing to catch up on).
        self.catch_up, self.burst = catch_up, burst
        self.drafted_last = False
        self.switches: dict[int, deque] = {}  # option -> its last unrated first steps (seconds, tokens)
        self.follow: tuple[int, int] | None = None  # (option, steps left) of a re-measurement's rated steps, next
        # a bucket's best is re-decided every `recheck` steps, not every step (off: at the next re-measurement): a
        # decision reads every option's rates and priors (~60 us of host time a step in the engine, where the target's
        # weights have left the caches cold: 1-3 % of a bs-1 CPU step, more of a GPU's), and the windows it reads move
        # little in a few steps. The kept choice ends early where a re-measurement falls due or the batch size changes.
        self.recheck = recheck
        self.kept: dict[str, tuple[int, int, int]] = {}  # bucket -> (best, batch size, step it is kept before)
        # defer: observations are queued and learnt at the next decision (choose past a kept choice) or read of the
        # stats: a kept choice reads none of them, so the choices are the same as learning each at once. In the engine
        # a step's observation cost ~30 us of host time learnt alone (the target's weights have left the caches
        # cold), a few us each when the queue's are learnt together.
        self.defer = defer
        self._queue: list[tuple] = []

    def _stat(self, i: int, bucket: str) -> RateWindow:
        st = self._stats.get((i, bucket))
        if st is None:
            st = self._stats[(i, bucket)] = RateWindow()
        return st

    @property
    def stats(self) -> dict[tuple[int, str], RateWindow]:
        """(option, bucket) -> its recent steps, every observation learnt."""
        self.settle()
        return self._stats

    @property
    def history(self) -> list[PerRequestWindow]:
        """Per option, its recent steps at any batch size, every observation learnt."""
        self.settle()
        return self._history

    def settle(self) -> None:
        """Learn the queued observations, in order."""
        queue, self._queue = self._queue, []
        for args in queue:
            self._learn(*args)

    def choose(self, batch_size: int) -> int:
        """Index into self.options for this step."""
        bucket = batch_bucket(batch_size)
        step = self.steps[bucket] = self.steps.get(bucket, 0) + 1
        kept = self.kept.get(bucket)
        if kept is not None and self.follow is None and kept[1] == batch_size and step < kept[2]:
            return kept[0]
        self.kept.pop(bucket, None)
        self.settle()
        ok = self._eligible(batch_size)
        if self.follow is not None:
            follow, left = self.follow
            self.follow = (follow, left - 1) if left > 1 and follow in ok else None
            if follow in ok:
                return follow
        known = self._nearest_measured(bucket, batch_size)
        model = self._model_rates(batch_size)
        if known is None and model is not None:
            known = bucket  # every option's rate follows from the model: no trial steps needed here
        if known is None:  # nothing measured nearby: try every option a few times, cheapest first
            for i in self._cheapest_first:
                if i in ok and self._stat(i, bucket).n < self.warmup and not self._ruled_out(i, bucket, batch_size):
                    return i
            known = bucket
        # a bucket the batch has just entered (requests finishing) starts from the nearest measured
        # one instead of exploring again: at a large batch an exploratory step is very slow
        rates = model if model is not None else self._rates(bucket, known, batch_size)
        best = max(ok, key=lambda i: rates[i] / (1.0 if self.options[i] is None else 1.0 + self.tree_margin))
        if self.best.get(bucket) != best:
            self._new_reference(bucket, best, rates)
        # re-measure each losing option now and then (acceptance drifts with the content, and its
        # first measurements may have been unlucky); one far behind the best ever less often (each
        # re-measurement costs a slow step), one close to it at the base interval
        for i in ok:
            if i != best and (bucket, i) not in self.next_retry:  # the first re-measurement is budgeted too
                self.next_retry[(bucket, i)] = step + max(
                    self.retry_every, self._budget_gap(i, best, bucket, known, batch_size, rates)
                )
        due = [i for i in ok if i != best and step >= self.next_retry[(bucket, i)]]
        if not due:
            until = min([self.next_retry[(bucket, i)] for i in ok if i != best], default=step + self.recheck)
            # off is kept until a tree's re-measurement: no tree runs before it, so what it would decide on is
            # off's own recent steps against each tree's from its last run (a switch then would follow only the
            # drift of off's steps since: the context's growth, the machine's)
            self.kept[bucket] = (
                best,
                batch_size,
                until if self.options[best] is None else min(step + self.recheck, until),
            )
            return best
        pick = min(due, key=lambda i: self.next_retry[(bucket, i)])
        gap = self.retry_gap.get((bucket, pick), self.retry_every)
        # NOTE: only once the option has a few steps: acceptance swings step to step, and a tree first
        # tried where the drafter had nothing to offer (the start of an answer) looked far behind
        # (an option with no steps here is rated by the prior, which rests on many steps elsewhere)
        n = self._stat(pick, bucket).n
        from_prior = not self._source(pick, bucket, known)[0].steps
        far = rates[pick] < self.far_behind * rates[best] and (n >= self.trust_after or from_prior)
        gap = min(2 * gap, self.max_retry_every) if far else self.retry_every
        self.retry_gap[(bucket, pick)] = gap
        # and never so often that re-measuring costs more than explore_budget of the time (shared by
        # the losing options): at a large batch one tree step (draft catch-up + a big verify) can cost
        # several plain steps (a budget per option let two losing trees cost twice the budget)
        lost = self.lost.get((bucket, pick), 0) if not self._came_close(pick, bucket) else 0
        self.next_retry[(bucket, pick)] = step + max(
            gap, self._budget_gap(pick, best, bucket, known, batch_size, rates) << min(lost, self.max_backoff)
        )
        if far and from_prior and gap < self.max_retry_every:
            # ruled out by the prior and never measured here: postpone rather than pay a slow step
            # (still measured for real once the back-off reaches its ceiling: the prior can be wrong)
            self.postponed += 1
            return best
        self.retries += 1
        self.lost[(bucket, pick)] = lost + 1  # (this one: counted as lost until its steps say otherwise)
        if self.catch_up and self.options[pick] is not None and not self.drafted_last:
            self.follow = (pick, self.burst)
        return pick

    def _came_close(self, i: int, bucket: str) -> bool:
        """Whether option i's last re-measurement (its rated steps: `burst` of them with catch_up) was as fast as the
        best: no loss (a tree within the tree margin is not chosen), so its re-measurements go back to the full budget.
        (Its windowed rate would lag: a tree whose content turned good needs many re-measurements to move it.)"""
        r = self.rel.get((i, bucket))
        if not r:
            return False
        last = list(r)[-(self.burst if self.catch_up else 1) :]
        return statistics.fmean(last) >= 1.0

    def _rates(self, bucket: str, known: str, batch_size: int) -> list[float]:
        """Each option's rate for this step's choice. The best option's own recent window is the
        reference; an option with a few ratios against it (measured next to its steps) is rated by them.
        NOTE: why ratios: the rate of an option re-measured every 32-512 steps comes from a window
        spanning thousands of steps, while the best's spans the last 32; the requests in the batch,
        their context lengths and the neighbours' load all drift in between (+-10-20 % at bs 4 here),
        which flips the choice towards trees slower than no speculation."""
        rates = [self._rate(i, bucket, known, batch_size) for i in range(len(self.options))]
        ref = self.best.get(bucket)
        if ref is not None and self._stat(ref, bucket).n >= self.warmup:
            for i in range(len(self.options)):
                r = self.rel.get((i, bucket))
                if i != ref and r is not None and len(r) >= self.warmup:
                    rates[i] = statistics.fmean(r) * rates[ref]
        return rates

    def _model_rates(self, batch_size: int) -> list[float] | None:
        """Every option's predicted rate at this batch size, or None until the model covers them all
        (acceptance, tree size and drafting seconds per request from at least `warmup` steps of each
        tree, and the verify cost of that many rows)."""
        ok = self._eligible(batch_size)
        if any(self.options[i] is not None and len(self._history[i].steps) < self.warmup for i in ok):
            return None
        rates = [self._prior(i, batch_size) if i in ok else 0.0 for i in range(len(self.options))]
        return None if None in rates else rates

    def _eligible(self, batch_size: int) -> list[int]:
        """The options this batch size may use (the confident cut only from its batch size on)."""
        return [i for i, m in enumerate(self.min_batch) if batch_size >= m]

    def _new_reference(self, bucket: str, best: int, rates: list[float]) -> None:
        """`best` takes over as this bucket's reference: the others' ratios were against the previous
        one, so they are rescaled by previous / best (their rates stay what they were), and the
        previous best starts with that ratio (its window was fresh: it ran until now)."""
        prev = self.best.get(bucket)
        self.best[bucket] = best
        self.lost.pop((bucket, best), None)
        self.rel.pop((best, bucket), None)
        if prev is None or rates[prev] <= 0 or rates[best] <= 0:
            return
        k = rates[prev] / rates[best]
        for (j, b), d in list(self.rel.items()):
            if b == bucket:
                self.rel[(j, b)] = deque((x * k for x in d), maxlen=d.maxlen)
        self.rel[(prev, bucket)] = deque([k] * self.warmup, maxlen=self.REL_WINDOW)

    def _budget_gap(self, i: int, best: int, bucket: str, known: str, batch_size: int, rates: list[float]) -> int:
        """Steps between re-measurements of option i so that the throughput they lose stays within its
        share of explore_budget. A step of i instead of one of best loses (1 - rate_i / rate_best) of
        its own duration: a tree whose step is slower but emits more tokens (bs 1) costs little to
        re-measure, one that is slow and emits no more (bs 64) costs nearly its whole step."""
        ratio = self._seconds(i, bucket, known, batch_size) / max(self._seconds(best, bucket, known, batch_size), 1e-9)
        rate_best = rates[best]
        lost = ratio * max(0.0, 1.0 - rates[i] / rate_best) if rate_best > 0 else ratio
        if self.catch_up and self.options[i] is not None and self.options[best] is None:
            # a re-measurement from off drafts 1 + burst steps: the first (unrated: catch_up) loses what it measured
            first = self.switches.get(i)
            if first and rate_best > 0:
                sec, tok = (statistics.fmean(x) for x in zip(*first))
                best_sec = max(self._seconds(best, bucket, known, batch_size), 1e-9)
                lost = self.burst * lost + sec / best_sec * max(0.0, 1.0 - tok / max(sec, 1e-9) / rate_best)
            else:
                lost *= self.burst + 1
        return math.ceil(lost * (len(self._eligible(batch_size)) - 1) / self.explore_budget)

    def _measured(self, bucket: str, batch_size: int) -> bool:
        return all(
            self._stat(i, bucket).n >= self.warmup or self._ruled_out(i, bucket, batch_size)
            for i in self._eligible(batch_size)
        )

    def _prior(self, i: int, batch_size: int) -> float | None:
        """Option i's predicted tokens/s at this batch size: its tokens and rows per request, measured at
        any batch size (acceptance does not depend on the batch), over the step time the cost model
        predicts for that many rows. None without the measurements to say."""
        if self.options[i] is None:  # off: one row and one token per request, no drafting
            seconds = self.cost.predict(batch_size)
            return None if seconds is None else batch_size / seconds
        h = self._history[i]
        seconds = self.cost.predict(batch_size * h.rows) if h.steps else None
        return None if seconds is None else batch_size * h.tokens / (seconds + batch_size * h.draft_seconds)

    def _ruled_out(self, i: int, bucket: str, batch_size: int) -> bool:
        """A tree whose prior is far behind 'off' here (off as measured in this bucket, else its prior), the prior
        resting on at least `warmup` of its steps (one step's acceptance is luck: a tree whose first step drafted
        nothing was ruled out, then re-measured one step at a time, as rarely as the far behind are)."""
        if self.options[i] is None or self._stat(i, bucket).n >= self.warmup:
            return False
        if len(self._history[i].steps) < self.warmup:
            return False
        off = self.options.index(None)
        mine = self._prior(i, batch_size)
        base = (
            self._stat(off, bucket).rate if self._stat(off, bucket).n >= self.warmup else self._prior(off, batch_size)
        )
        return mine is not None and bool(base) and mine < self.far_behind * base

    def _nearest_measured(self, bucket: str, batch_size: int) -> str | None:
        """This bucket, else a measured neighbour (half or double the batch), else None.
        NOTE: only a neighbour: from bs 16 to bs 64 the best tree changes (a verify step's cost grows
        with the batch), and a sweep that jumps 16 -> 64 would pay for bs 16's big tree until bs 64's own
        measurements take over."""
        if self._measured(bucket, batch_size):
            return bucket

        def distance(b: str) -> float:
            return abs(math.log2(int(b)) - math.log2(int(bucket)))

        near = [b for b in {b for _, b in self._stats} if distance(b) <= 1 and self._measured(b, int(b))]
        return min(near, key=distance, default=None)

    def _source(self, i: int, bucket: str, known: str) -> tuple[RateWindow, float]:
        """Where option i's numbers come from: this bucket once it has a few steps of i, else the
        known bucket, whose rate is scaled by their batch sizes (rates are tokens/s of the batch)."""
        own = self._stat(i, bucket)
        if own.n >= self.warmup or known == bucket:
            return own, 1.0
        return self._stat(i, known), int(bucket) / int(known)

    def _seconds(self, i: int, bucket: str, known: str, batch_size: int) -> float:
        st = self._source(i, bucket, known)[0]
        if st.steps:
            return st.median_seconds
        h = self._history[i]  # never run near here: the seconds the cost model predicts for its rows
        return (self.cost.predict(batch_size * h.rows) if h.steps else None) or 0.0

    def _rate(self, i: int, bucket: str, known: str, batch_size: int) -> float:
        st, scale = self._source(i, bucket, known)
        if not st.steps:
            return self._prior(i, batch_size) or 0.0
        return st.rate * scale

    def observe(
        self,
        option: int,
        batch_size: int,
        seconds: float,
        tokens: int,
        rows: int | None = None,
        draft_seconds: float = 0.0,
        accepted: list[int] | None = None,
        drafted: list[int] | None = None,
        first: bool = False,
    ) -> None:
        """One step's outcome. `rows` = verify rows (requests + draft nodes) feeds the step-cost model
        (with the step's seconds minus `draft_seconds`, the proposal's share); `accepted` / `drafted`
        (per request: accepted draft tokens, draft nodes) also rate the shorter chains nested in a chain
        that ran, without running them. `first`: a request drafted for the first time, over its prompt too (EAGLE-3
        puts the layer's K/V of every prompt pair in its cache then, counted as a slow tree or a dear switch for 64
        steps): a cost of the request, paid once whenever it drafts, so the step is not rated."""
        switched = self.catch_up and self.options[option] is not None and not self.drafted_last
        self.drafted_last = self.options[option] is not None
        args = (option, batch_size, seconds, tokens, rows, draft_seconds, accepted, drafted, first, switched)
        self._queue.append(args)
        if not self.defer:
            self.settle()

    def _learn(
        self,
        option: int,
        batch_size: int,
        seconds: float,
        tokens: int,
        rows: int | None,
        draft_seconds: float,
        accepted: list[int] | None,
        drafted: list[int] | None,
        first: bool,
        switched: bool,
    ) -> None:
        """observe's learning (its arguments; switched: a first drafted step after steps without drafting)."""
        self.clock += 1
        if first:  # a request's first drafted step: its prompt's catch-up, a cost of the request, unrated
            return
        if switched:  # (the drafter's catch-up: see catch_up) its cost counts against the re-measurement budget
            self.switches.setdefault(option, deque(maxlen=8)).append((seconds, tokens))
            return
        bucket = batch_bucket(batch_size)
        ref = self.best.get(bucket)
        if ref is not None and option != ref and self._stat(ref, bucket).n >= self.warmup:
            level = self._stat(ref, bucket).rate
            if level > 0:
                rate = self._stat(option, bucket).step_rate(seconds, tokens)
                self.rel.setdefault((option, bucket), deque(maxlen=self.REL_WINDOW)).append(rate / level)
        self._stat(option, bucket).add(seconds, tokens)
        if rows is not None:
            self.cost.add(rows, max(seconds - draft_seconds, 1e-9))
            self._history[option].add(self.clock, batch_size, rows, tokens, draft_seconds)
            if accepted is not None and drafted is not None:
                self._counterfactual(option, accepted, drafted)

    def _counterfactual(self, option: int, accepted: list[int], drafted: list[int]) -> None:
        """A chain of depth d nested in the chain that ran (same drafter, greedy per step: its drafts are
        the first d of the longer chain's) would have emitted min(accepted, d) + 1 tokens per request
        from 1 + min(drafted, d) rows. NOTE: an estimate for rating only; drafting seconds are left to
        its own steps (a shorter chain drafts less: what it last measured, else nothing)."""
        ran = self.options[option]
        if ran is None or ran.topk != 1:
            return
        for j, shape in enumerate(self.options):
            if (
                j == option
                or shape is None
                or shape.topk != 1
                or shape.depth > ran.depth
                or shape.min_prob != ran.min_prob
                or getattr(shape, "members", ()) != getattr(ran, "members", ())
            ):
                continue  # (a chain cut at another min_prob or drafted by other members: not the first nodes)
            d = shape.depth
            h = self._history[j]
            per_draft = h.draft_seconds if h.steps else 0.0
            h.add(
                self.clock,
                len(accepted),
                sum(1 + min(n, d) for n in drafted),
                sum(min(a, d) + 1 for a in accepted),
                per_draft * len(accepted),
            )
