"""Where an engine step's time goes, and what plain decoding gives at large batch sizes.

    profile_steps(target, drafter, tree, prompt)           # one request in its steady state
    vanilla_throughput(target, prompts, max_new_tokens=128)  # aggregate tok/s of a static batch

profile_steps times steps one by one (median), then records a few under torch.profiler: the ops
with the most self CPU and self device time, and per step the kernel launches, graph launches
(a CUDA graph replayed), host<->device copies and synchronizations, counted from the CUDA
runtime calls the profiler sees. On a CPU the device columns are zero; the code path is the same.
"""

from __future__ import annotations

import statistics
import time

import torch

# CUDA runtime / driver calls, by what they mean for a step's host cost
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_CALLS = ("cudaGraphLaunch",)
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemcpy2DAsync", "cudaMemsetAsync")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP_OPS = 12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steady_engine(target, drafter, tree, prompt: list[int], max_new_tokens: int):
    """An engine serving one request that is past its prefill (ignores EOS: it stays running)."""
    from serving.config import EngineConfig
    from serving.engine import Engine
    from sglang_ext.sampling import SamplingParams

    kv = len(prompt) + max_new_tokens + 4 * (tree.num_draft_tokens + 2) + 64
    engine = Engine(target, drafter, EngineConfig(tree=tree, kv_slots=kv, prefix_cache=False))  # (repeated prompts)
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    while engine.waiting:
        engine.step()
    return engine, req


def _self_device_us(e) -> float:
    return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)


def _op_row(e, steps: int) -> dict:
    return {
        "op": e.key,
        "calls_per_step": e.count / steps,
        "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
        "self_device_ms_per_step": _self_device_us(e) / 1e3 / steps,
    }


def _calls(events, names: tuple[str, ...], steps: int) -> float:
    return sum(e.count for e in events if e.key in names) / steps


def profile_steps(
    target, drafter, tree, prompt: list[int], warmup_steps: int = 4, timed_steps: int = 10, profiled_steps: int = 3
) -> dict:
    """One request decoding (drafter None: vanilla) after warmup_steps steps (graphs captured, caches
    warm): the median wall time of timed_steps single steps, then profiled_steps steps under
    torch.profiler, reported per step. `replayed_graph`: the profiled steps launched a CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    steps = warmup_steps + timed_steps + profiled_steps
    engine, req = _steady_engine(target, drafter, tree, prompt, max_new_tokens=(steps + 2) * (tree.depth + 2))
    device = engine.model.device
    for _ in range(warmup_steps):
        engine.step()
    _sync(device)
    times, tokens = [], len(req.output_ids)
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    tokens = len(req.output_ids) - tokens
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled_steps):
            engine.step()
        _sync(device)
    events = prof.key_averages()
    ops = [e for e in events if not e.key.startswith(("cuda", "cu", "ProfilerStep"))]
    by_cpu = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    by_dev = sorted((e for e in events if _self_device_us(e) > 0), key=_self_device_us, reverse=True)[:TOP_OPS]
    graph_launches = _calls(events, GRAPH_CALLS, profiled_steps)
    device_us = sum(_self_device_us(e) for e in events)
    engine.abort(req)
    return {
        "method": drafter.name if drafter is not None else "vanilla",
        "tree": "-" if drafter is None else tree.label,
        "prompt_tokens": len(prompt),
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_min": 1e3 * min(times),
        "tokens_per_step": tokens / timed_steps,
        "tokens_per_s": tokens / sum(times),
        "profiled_steps": profiled_steps,
        "kernel_launches_per_step": _calls(events, LAUNCH_CALLS, profiled_steps),
        "graph_launches_per_step": graph_launches,
        "replayed_graph": graph_launches > 0,
        "copies_per_step": _calls(events, COPY_CALLS, profiled_steps),
        "syncs_per_step": _calls(events, SYNC_CALLS, profiled_steps),
        "device_busy_ms_per_step": device_us / 1e3 / profiled_steps,
        "top_self_cpu": [_op_row(e, profiled_steps) for e in by_cpu],
        "top_self_device": [_op_row(e, profiled_steps) for e in by_dev],
    }


def vanilla_throughput(
    target, prompts: list[list[int]], max_new_tokens: int, warmup_tokens: int = 4, overlap: bool = True
) -> dict:
    """Every prompt at once in one engine without a drafter, each generating max_new_tokens (EOS
    ignored, so every request runs its full length): aggregate tok/s over the whole run (prefill
    included: what a distillation run gets) and over its decode phase (steps after the last prefill).
    overlap: EngineConfig.overlap (`overlap` in the result: whether the overlapped loop ran, a GPU's case)."""
    from serving.config import EngineConfig
    from serving.engine import Engine
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    kv = sum(map(len, prompts)) + len(prompts) * (max_new_tokens + 2) + 64
    config = EngineConfig(tree=TreeShape.chain(1), kv_slots=kv, prefix_cache=False, overlap=overlap)
    engine = Engine(target, None, config)
    engine.generate(prompts, SamplingParams(max_new_tokens=warmup_tokens, ignore_eos=True))  # graphs captured
    device = engine.model.device
    _sync(device)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    steps = decode_steps = 0
    t_decode, tokens_at_decode = None, 0
    while engine.has_work:
        engine.step()
        steps += 1
        if t_decode is None and not engine.waiting:
            _sync(device)
            t_decode, tokens_at_decode = time.perf_counter(), sum(len(r.output_ids) for r in reqs)
        elif t_decode is not None:
            decode_steps += 1
    _sync(device)
    t1 = time.perf_counter()
    tokens = sum(len(r.output_ids) for r in reqs)
    decode_s = t1 - t_decode if t_decode is not None else 0.0
    return {
        "batch_size": len(prompts),
        "overlap": engine.overlap.applies(),
        "prompt_tokens": sum(map(len, prompts)),
        "new_tokens": tokens,
        "seconds": t1 - t0,
        "steps": steps,
        "tokens_per_s": tokens / (t1 - t0),
        "decode_steps": decode_steps,
        "decode_tokens_per_s": (tokens - tokens_at_decode) / decode_s if decode_s > 0 else None,
        "decode_step_ms": 1e3 * decode_s / decode_steps if decode_steps else None,
    }
