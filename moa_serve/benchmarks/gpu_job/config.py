"""The GPU engine job's settings, its methods and its deadline (shared by the sections)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEFAULT_METHODS = ("ngram", "suffix", "lookahead", "eagle3", "moa", "medusa", "suffix+eagle3")
# On a GPU a verify of tens of tree nodes costs about one decode (../shared/notes/gpu.md), so drafters
# draft deeper and wider trees there than their registry defaults, which are tuned for a 2-core CPU.
GPU_TREES = {
    "ngram": "6,2,12",
    "suffix": "8,3,24",
    "eagle3": "6,4,24",
    "moa": "6,4,24",
    "medusa": "4,4,16",
    "suffix+eagle3": "8,4,32",
}

SMOKE_VOCAB = 256  # the smoke target reads prompts as UTF-8 bytes

SMOKE_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class GpuJobConfig:
    out: str
    target_gguf: str | None = None  # converted once into `cache` (needs gguf, only then)
    model: str = "smollm2"  # without target_gguf: 'smollm2' or a local HF directory
    smoke: bool = False  # a small random target of SmolLM2's family, tiny sizes (smoke_sizes)
    device: str = "auto"
    methods: tuple[str, ...] = DEFAULT_METHODS  # 'name' or 'name:d,k,n'; vanilla always runs
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    throughput_batch_sizes: tuple[int, ...] = (1, 64, 256)  # (1: the steady-state bs-1 step, overlapped or not)
    profile_methods: tuple[str, ...] = ("eagle3",)  # profiled beside vanilla (the first loaded one when none is)
    identity_batch_sizes: tuple[int, ...] = (1, 4)
    identity_prompts: int = 4
    eval_sets: tuple[str, ...] = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
    num_prompts: int = 2  # per eval set, in the bs1 section
    sweep_min_prompts: int = 8  # a sweep run at batch size b serves max(this, 2b) prompts
    max_new_tokens: int = 128
    deadline_min: float = 8.0
    gpu_tests: tuple[str, ...] = ("tests",)  # paths for `pytest -m gpu`; () skips the section
    gpu_tests_reserve_s: float = 90.0  # kept free for the tests when deciding whether to measure more
    cache: str = "/tmp/moa-serve-gpu-job-cache"
    commit: str | None = None


@dataclass
class JobMethod:
    """A drafter of the run: `source` is what make_drafter builds it from (a name, or a path)."""

    label: str
    source: str
    tree: object  # TreeShape
    drafter: object = None
    skipped: str | None = None  # "skipped: why" when it cannot load on this target


@dataclass
class Deadline:
    seconds: float
    t0: float = field(default_factory=time.perf_counter)
    stopped: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def allows(self, what: str, need_s: float) -> bool:
        """Whether `what` (expected to take need_s) still fits; when not, it is recorded as left out."""
        if self.left() > need_s:
            return True
        self.stopped.append(f"{what}: left out, {self.left():.0f} s left, ~{need_s:.0f} s needed")
        return False


def log(msg: str) -> None:
    print(f"[gpu-job {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tests_reserve(c: GpuJobConfig) -> float:
    return c.gpu_tests_reserve_s if c.gpu_tests else 0.0


def smoke_sizes(c: GpuJobConfig) -> GpuJobConfig:
    """The smoke run: the same sections at sizes a 2-core CPU runs in seconds."""
    return replace(
        c,
        batch_sizes=(1, 2),
        throughput_batch_sizes=(2, 4),
        identity_batch_sizes=(1, 2),
        identity_prompts=min(c.identity_prompts, 2),
        num_prompts=1,
        sweep_min_prompts=2,
        max_new_tokens=min(c.max_new_tokens, 8),
    )
