"""The job's driver: load, run every section in order under one deadline, write the results."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .config import Deadline, GpuJobConfig, log, smoke_sizes
from .inputs import job_prompts, load_job_target, load_methods, round_robin
from .probes import gpu_tests_section, profile_section, throughput_section
from .report import header, headline, json_safe, markdown
from .sections import best_drafter, bs1_section, identity_section, sweep_section


def _section(payload: dict, name: str, fn, out: Path) -> None:
    """payload[name] = fn(); a section that raises is reported with its error, and the job goes on.
    results.json is rewritten after each section (marked partial), so a command killed at its time
    limit still returns what was measured."""
    t0 = time.perf_counter()
    try:
        payload[name] = fn()
    except Exception as e:  # noqa: BLE001 - one broken section must not cost the others their numbers
        import traceback

        traceback.print_exc()
        payload[name] = {"error": f"{type(e).__name__}: {e}"}
    payload.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
    log(f"{name} done in {time.perf_counter() - t0:.0f} s")
    (out / "results.json").write_text(json.dumps(json_safe({**payload, "partial": True}), indent=1) + "\n")


def measure(c: GpuJobConfig, device: str, deadline: Deadline) -> dict:
    """Load the target and drafters; the identity, bs1 and sweep sections -> the payload so far."""
    from sglang_ext.sampling import SamplingParams

    target = load_job_target(c, device)
    log(f"target {target.path} on {device} ({target.model.dtype}), {time.perf_counter() - deadline.t0:.0f} s")
    # the smoke target's random weights may stop at once: it ignores EOS, so every run has its length
    sp = SamplingParams(max_new_tokens=c.max_new_tokens, ignore_eos=c.smoke)
    prompts_by_set = job_prompts(c, target)
    mixed = round_robin(prompts_by_set)
    methods = load_methods(c, target, device, mixed)
    out = Path(c.out)
    payload = header(c, target, device)
    payload["methods"] = [{"method": m.label, "tree": m.tree.label, "status": m.skipped or "loaded"} for m in methods]
    payload["eval_sets"] = {name: len(p) for name, p in prompts_by_set.items()}
    _section(payload, "profile", lambda: profile_section(c, target, methods, mixed, deadline), out)
    _section(payload, "identity", lambda: identity_section(c, target, methods, mixed, sp, deadline), out)
    _section(payload, "bs1", lambda: bs1_section(c, target, methods, prompts_by_set, sp, deadline), out)
    best = best_drafter(payload["bs1"].get("pooled", []), methods)
    _section(payload, "sweep", lambda: sweep_section(c, target, best, mixed, sp, deadline), out)
    _section(payload, "throughput", lambda: throughput_section(c, target, mixed, deadline), out)
    return payload


def run_job(c: GpuJobConfig) -> dict:
    """Run every section on c.device; write results.json and table.md under c.out; return the payload."""
    from sglang_ext.models import resolve_device

    deadline = Deadline(c.deadline_min * 60)
    c = smoke_sizes(c) if c.smoke else c
    out = Path(c.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(c.device)
    payload = measure(c, device, deadline)  # the target and drafters are freed when it returns
    if device != "cpu":
        torch.cuda.empty_cache()  # the tests get the GPU's memory
    cache = c.cache if c.target_gguf else None
    _section(payload, "gpu_tests", lambda: gpu_tests_section(c.gpu_tests, deadline, out, cache), out)
    payload["headline"] = headline(payload)
    payload["seconds"] = time.perf_counter() - deadline.t0
    payload["deadline"] = {"seconds": deadline.seconds, "stopped": deadline.stopped}
    payload = json_safe(payload)
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "table.md").write_text(markdown(payload))
    return payload
