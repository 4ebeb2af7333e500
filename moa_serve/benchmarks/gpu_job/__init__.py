"""The GPU engine job: one run on one device that measures where the embedded engine stands there.

    run_job(GpuJobConfig(out="runs/gpu-engine", target_gguf=".../SmolLM2-135M-Instruct.Q4_1.gguf", device="cuda"))
    run_job(GpuJobConfig(out="/tmp/smoke", smoke=True, device="cpu"))   # the same code path on a random target

Sections, each measured in this one run (machines are noisy, so every ratio is against a row of the same run):
  profile    one request's steady-state step, vanilla and EAGLE-3 (else the first drafter loaded): median
             step time, top ops by self CPU / device time, kernel and graph launches, copies and syncs
             per step (probes.py, moa_serve/benchmarks/step_profile.py)
  identity   every drafter's greedy tokens against vanilla's on the device, at batch sizes 1 and 4 (sections.py)
  bs1        tok/s, tau and draft tokens per step per method at batch size 1, methods and the transformers
             `generate` peer (on the same device) interleaved prompt by prompt (moa_serve/benchmarks/bench.py)
  sweep      batch sizes 1 / 8 / 64: vanilla, the best drafter of bs1, and that drafter with adaptive
             speculation, interleaved step by step (moa_serve/benchmarks/batch.py); outputs checked against vanilla's
  throughput vanilla decoding of a static batch at batch sizes 1, 64 and 256 (EOS ignored): aggregate tok/s,
             what a distillation run on the device gets, with the overlapped loop and without it (probes.py)
  gpu_tests  `pytest -m gpu` in a subprocess, its summary line (probes.py)
  headline   the numbers a reader looks for first (report.py); values only: docs/BENCHMARKS.md compares them
             with the project's goals
Results: results.json (every number), table.md (short), profile.txt. A section that raises is reported with
its error and the others still run. A deadline (wall time of the whole job) stops adding measurements when
too little time is left for the next one; what was left out is listed under "deadline".

Layout: config.py (settings, methods, deadline) <- inputs.py (target, prompts, drafters) <- sections.py,
probes.py <- report.py <- job.py (the driver). Imports only what a lent GPU machine has (torch,
transformers, safetensors, numpy, pytest): no fastapi / uvicorn / xgrammar / sglang, gguf only to convert
a GGUF, and our C++ CPU kernels are optional (sglang_ext/kernels falls back to torch).
"""

from .config import DEFAULT_METHODS, GpuJobConfig
from .job import run_job
from .report import markdown

__all__ = ["DEFAULT_METHODS", "GpuJobConfig", "markdown", "run_job"]
