"""The scheduler: which requests a step runs, and how (nano-vllm's and SGLang's scheduler, vLLM's core/sched).

    add ──► waiting (a WaitingQueue: prompts not prefilled yet)
              │  each step: prompt chunks within the prefill budget (chunked prefill); a prompt done leaves
              ▼
            running (decoding: one tree each per step) ──► finished: removed (the engine frees their KV)

Batch formation (`prefill`, one of PREFILL_MODES):
  first     (the default) a newcomer, a request whose tenant (Request.share) has nothing running, gets a step
            of its own for its prompt, so its first token streams after its prefill alone, not after a forward
            it shares with another tenant's trees (its time to first token under another tenant's load: the
            step in progress + its own prefill); the step after such a step decodes, so decoding is held up one
            step in two at most however fast newcomers come. Every other prompt rides in the decode forward
            as in "mixed": with one tenant, "first" is "mixed".
  mixed     one forward per step holds the running trees and the prompt chunks side by side (the prompt rows
            share the pass over the weights with the decode rows, and arrivals one or two at a time, what
            speculation's uneven finishing gives, cost no more than arrivals in a group)
  separate  the chunks' forward, then the decode forward, in one step (both delivered when the step ends)

The waiting queue is one object with a small interface (push, pop_next, remove, len, iteration in serving
order), so another order drops in. Which requests reach the engine at all, and in which order between tenants, is
decided before it: the engine loop's admission queue (serving/engine_loop.py) is a per-tenant fair queue
(serving/tenancy.py's FairQueue).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .config import PREFILL_MODES
from .request import Request

T = TypeVar("T")


class WaitingQueue(Generic[T]):
    """Items waiting their turn, served first in, first out (iteration and pop_next give the serving order)."""

    def __init__(self):
        self._items: list[T] = []

    def push(self, item: T) -> None:
        self._items.append(item)

    def pop_next(self) -> T:
        return self._items.pop(0)

    def remove(self, item: T) -> bool:
        """Take the item out wherever it waits (an abort); False when it is not here."""
        for i, x in enumerate(self._items):
            if x is item:
                del self._items[i]
                return True
        return False

    def clear(self) -> list[T]:
        items, self._items = self._items, []
        return items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items))

    def __contains__(self, item: object) -> bool:
        return any(x is item for x in self._items)


Batch = tuple[list[Request], list[tuple[Request, int]]]  # (decoding requests, prompt chunks (request, end))


class Scheduler:
    """The engine's waiting and running requests and each step's batches. prefill_tokens: prompt tokens
    prefilled per step at most (longer prompts in chunks); prefill: how chunks and decoding share steps
    (PREFILL_MODES, above)."""

    def __init__(self, prefill_tokens: int, prefill: str = "first"):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
        self.prefill_tokens, self.prefill = prefill_tokens, prefill
        self._held_back = False  # prefill "first": the last step ran chunks alone while requests were decoding
        self.waiting: WaitingQueue[Request] = WaitingQueue()
        self.running: list[Request] = []
        self.in_step: list[Request] = []  # taken from `waiting` by this step: a failed step's reset releases them

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> list[Request]:
        """Every request the engine holds between steps: waiting, then running."""
        return list(self.waiting) + self.running

    def add(self, r: Request) -> None:
        self.waiting.push(r)

    def schedule(self, match_prefix: Callable[[Request], None]) -> list[Batch]:
        """This step's forwards: (decoding requests, prompt chunks) each. match_prefix(r): the KV manager looks
        the prompt of a request about to start its prefill up in the prefix cache again."""
        decoding = list(self.running)
        if self.prefill == "first" and decoding and not self._held_back:
            busy = {r.share for r in decoding}
            newcomers = [r for r in self.waiting if r.share not in busy]
            if newcomers:
                self._held_back = True
                chunks = self._prefill_chunks(match_prefix, newcomers)
                self.in_step = [r for r, _ in chunks]
                return [([], chunks)]
        self._held_back = False
        chunks = self._prefill_chunks(match_prefix, list(self.waiting))
        self.in_step = [r for r, _ in chunks]
        if self.prefill == "separate":
            return ([([], chunks)] if chunks else []) + ([(decoding, [])] if decoding else [])
        return [(decoding, chunks)] if decoding or chunks else []

    def _prefill_chunks(
        self, match_prefix: Callable[[Request], None], candidates: list[Request]
    ) -> list[tuple[Request, int]]:
        """The prompt chunks this step prefills from `candidates` (waiting requests in serving order): (request,
        end) for prompt tokens [r.prefilled, end).
        NOTE: at most prefill_tokens prompt tokens per step; a prompt that does not fit is split
        (chunked prefill), so one long prompt holds the running requests' next tokens up for one
        chunk's time, not its whole prefill. A request whose prompt is done leaves the queue; one split
        stays in its place."""
        chunks, budget = [], self.prefill_tokens
        for r in candidates:
            if budget <= 0:
                break
            if r.prefilled == r.shared:  # nothing prefilled yet: the cache may hold more of its prompt by now
                match_prefix(r)
            end = min(len(r.prompt_ids), r.prefilled + budget)
            chunks.append((r, end))
            budget -= end - r.prefilled
        for r, end in chunks:
            if end == len(r.prompt_ids):
                self.waiting.remove(r)
        return chunks

    def start_decoding(self, r: Request) -> None:
        """The request's prompt is prefilled and its first token out: it decodes from the next step on."""
        self.running.append(r)

    def remove(self, r: Request) -> bool:
        """Take the request out of the waiting and running lists; whether it was running."""
        self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)
            return True
        return False

    def end_step(self) -> None:
        self.in_step = []

    def held(self) -> list[Request]:
        """Every request held: waiting, running, and those a failed step took from waiting."""
        left = self.requests()
        return left + [r for r in self.in_step if not any(r is x for x in left)]

    def clear(self) -> None:
        self.waiting.clear()
        self.running, self.in_step = [], []
        self._held_back = False
