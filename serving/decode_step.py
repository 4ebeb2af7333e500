"""A plain greedy decode step replayed whole: no drafter, every request greedy on the raw logits without
logprobs, no prompt chunk, a graph bucket. One new KV slot per request, one graph replay (the forward, the
logits and their argmax; the prefixes from the graph runner's slot table on the device), the tokens in the
step's one device-to-host copy, the slots appended (one cat for the batch, each request's a view of it). It
gives the tree path's tokens (a root-only tree's path is its root, its token the target's argmax there) in
a fixed number of host ops for the batch (moa_serve/benchmarks/step_ops.py counts them)."""

from __future__ import annotations

from sglang_ext.device import grow
from sglang_ext.verify import tokens_to_host

from .request import Request, RequestFault, StepEvent, fail
from .sampler import Sampler
from .spec_worker import SpecWorker


def plain_decode(engine, reqs: list[Request]) -> bool:
    """Whether a step of these decoding requests (no prompt chunk) takes `decode_step`."""
    return (
        engine.runner.graph_runner is not None  # (first: on the CPU no step takes this path)
        and engine.drafter is None
        and type(engine.sampler) is Sampler
        and type(engine.spec) is SpecWorker
        and all(engine.sampler.plain_greedy(r) and r.params.logprobs is None for r in reqs)
        and engine.runner.can_decode(reqs)
    )


def decode_step(engine, reqs: list[Request]) -> list[StepEvent]:
    """The step (see the module docstring) for the engine's decoding requests."""
    kv = engine.kv_manager
    slots = kv.alloc(len(reqs))
    try:
        tokens = tokens_to_host(engine.runner.decode(reqs, slots))  # the step's one device-to-host copy
    except BaseException:
        kv.free(slots)
        raise
    events = []
    for r, s, tok in zip(reqs, grow([r.slots for r in reqs], list(slots.split(1))), tokens):
        r.slots = s
        r.stats.verify_steps += 1
        try:
            events.append(StepEvent(r, engine.sampler.append(r, [tok]), 0, 0))
        except RequestFault as f:
            events.append(fail(r, f))
    return events
