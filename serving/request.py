"""A request's state in the engine (Request, its stats), what a step did for it (StepEvent), where the target
pool's slots are (SlotAccounts, CacheFlush), and a fault blamed on one request alone (RequestFault, raised
inside a `stage`; `fail` ends the request): the data the engine's parts (serving/engine.py) work on and hand out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sglang_ext.drafters import DraftInput
from sglang_ext.sampling import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


class RequestFault(Exception):
    """A fault while computing something for one request alone; `reason` names the stage."""

    def __init__(self, reason: str):
        super().__init__(f"fault in stage {reason!r}")
        self.reason = reason


@contextmanager
def stage(reason: str) -> Iterator[None]:
    """Any exception inside becomes a RequestFault(reason) (an inner stage's fault keeps its own reason)."""
    try:
        yield
    except RequestFault:
        raise
    except Exception as e:
        raise RequestFault(reason) from e


def path_nodes(nodes: list[int], n: int) -> list[int]:
    """An accepted path's node indices as indices into its tree's n nodes (a negative one counts from the end,
    as indexing does); an index outside the tree raises, as indexing with it would."""
    out = [int(x) for x in nodes]
    if any(not -n <= x < n for x in out):
        raise IndexError(f"accepted nodes {out} outside a tree of {n} nodes")
    return [x % n for x in out]


@dataclass
class RequestStats:
    verify_steps: int = 0
    draft_tokens: int = 0  # tree nodes proposed (root excluded)
    accepted_tokens: int = 0  # draft tokens accepted (bonus excluded)
    accepted_by_depth: list[int] = field(default_factory=list)  # accepts at draft position i

    @property
    def accept_length(self) -> float:
        """tau: mean (accepted + 1) per verify step."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(
        default_factory=list
    )  # one per output token when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(
        default_factory=list
    )  # prompt tokens 1.. when params.prompt_logprobs is set
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    prefilled: int = 0  # prompt tokens whose K/V the target holds (a long prompt is prefilled over several steps)
    prompt_captured: list = field(default_factory=list)  # the target's captured layers for the chunks so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish_reason "error": the stage whose fault ended this request alone
    drafting: bool = True  # False after a drafter failure: vanilla decoding from then on
    drafted: bool = False  # a measured step drafted for it (its first also drafted over its prompt: spec_worker)
    coupling_seed: int | None = None  # an unseeded sampled request's seed for coupled verification (Sampler's)
    matcher: object | None = None  # the grammar's state after the output so far (structured output)
    reference: list[int] = field(
        default_factory=list
    )  # the prompt's last tokens + its predicted output, for the drafter
    stats: RequestStats = field(default_factory=RequestStats)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    tenant: str = ""  # the prefix cache's namespace (API key, cache_salt): only its own tenant's prefixes are hit
    share: str = ""  # who it belongs to for fair scheduling (its API key's tenant name; serving/scheduler.py)
    cached_tokens: int = 0  # leading prompt tokens found in the prefix cache at admission (not prefilled)
    shared: int = 0  # leading tokens whose slots are the prefix cache's (slots[:shared], locked while it runs)
    cache_node: object | None = None  # the prefix cache's node where that shared path ends

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_input(self, params: SamplingParams | None = None) -> DraftInput:
        """What the drafter reads of this request (`params`: those it drafts for, the request's own by default)."""
        params = self.params if params is None else params
        return DraftInput(self.rid, self.token_ids, params, self.generator, self.reference, self.tenant, self.slots)


@dataclass(frozen=True)
class SlotAccounts:
    """Where the target pool's slots are: free, in the prefix cache (detached: flushed while a request still uses
    them), or the requests' own. None is ever lost: `lost` is 0."""

    capacity: int
    free: int
    cached: int
    detached: int
    held: int

    @property
    def lost(self) -> int:
        return self.capacity - self.free - self.cached - self.detached - self.held


@dataclass(frozen=True)
class CacheFlush:
    """What a flush did: tokens freed now, and tokens running requests still use (freed when they end)."""

    freed: int
    kept: int
    running: int


@dataclass
class StepEvent:
    """What one step did for one request: the tokens it appended (already truncated at stop/length)."""

    request: Request
    new_tokens: list[int]
    accepted: int  # draft tokens accepted in this step (0 for prefill or vanilla)
    drafted: int  # draft tokens proposed in this step
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token, when the request asked for them


def fail(r: Request, fault: RequestFault) -> StepEvent:
    """End one request after a fault in its own stage (finish_reason "error", `error` = the stage); the step's
    other requests carry on."""
    cause = fault.__cause__ or fault
    log.error("request %d failed in stage %r; the other requests carry on", r.rid, fault.reason, exc_info=cause)
    r.finish_reason, r.error = "error", fault.reason
    return StepEvent(r, [], 0, 0)
