"""One engine configuration: which model and drafter to load and every setting of the Engine.

    config = EngineConfig(drafter="suffix", kv_slots=8192, adaptive=True)
    engine = build_engine(config)             # serving/engine.py: loads the target, builds the drafter
    engine = Engine(target, drafter, config)  # or around a target and drafter built elsewhere (tests)

The command line turns its flags into an EngineConfig at its edge (moa_serve/entrypoints/flags.py: engine_config);
nothing below it reads argparse. build_engine lives beside Engine in serving/engine.py: Engine reads
its settings from an EngineConfig, so this module cannot import the engine back (no import cycles
between modules, tests/test_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_ext.models import DEFAULT_TARGET, DEVICE_CHOICES, parse_dtype
from sglang_ext.tree import TreeShape

PREFILL_MODES = ("first", "mixed", "separate")  # serving/scheduler.py: how prompt chunks and decoding share steps


@dataclass(frozen=True)
class EngineConfig:
    """Settings are checked when the config is made, so a bad one fails before any model loads."""

    model: str = DEFAULT_TARGET  # 'smollm2' or a local HF Llama/Qwen directory
    dtype: str = "auto"  # auto | bfloat16 | float32 (auto: sglang_ext.models.auto_dtype: bf16 on a GPU)
    device: str = "auto"  # auto | cpu | cuda[:N] (auto: cuda when torch sees a GPU)
    drafter: str | None = "auto"  # registry name, a checkpoint / corpus directory, 'none', or 'auto'
    tree: TreeShape | None = None  # None: the drafter's default tree (its registry entry); 'd,k,n' text is parsed
    kv_slots: int = 16384  # target KV pool size in tokens
    max_context: int | None = None  # context limit (None: the model's)
    adaptive: bool = False  # per-step tree / no speculation from measured throughput (the serving default)
    prefill_tokens: int = 512  # prompt tokens prefilled per step at most (longer prompts in chunks)
    # how arrivals' prompt chunks and the running requests share steps: first | mixed | separate
    # (serving/scheduler.py: "first" streams a new request's first token after its prefill alone)
    prefill: str = "first"
    # decode / verify forwards at bucketed shapes replayed from CUDA graphs (sglang_ext/models/graph_runner.py);
    # effective on a CUDA device only, eager outside the buckets
    cuda_graphs: bool = True
    # the overlapped loop: a plain decode step or an EAGLE-3 / MoA step is issued before the previous one's
    # results are read, the host's work for a step done while the device runs the next (serving/decode_step.py,
    # serving/spec_step.py); effective where
    # steps replay graphs on an asynchronous device (CUDA), outputs identical either way
    overlap: bool = True
    # reuse the KV of prompt prefixes earlier requests of the same tenant computed (serving/prefix_cache.py)
    prefix_cache: bool = True
    prefix_cache_tokens: int | None = None  # most tokens the prefix cache keeps (None: what the KV pool has room for)

    def __post_init__(self):
        if isinstance(self.tree, str):
            object.__setattr__(self, "tree", TreeShape.parse(self.tree))
        if self.tree is not None and not isinstance(self.tree, TreeShape):
            raise ValueError(f"tree must be a TreeShape or 'depth,topk,num_draft_tokens' text, got {self.tree!r}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)  # raises for an unknown name
        if self.device not in DEVICE_CHOICES and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICE_CHOICES)} (or cuda:N)")
        if self.kv_slots < 1:
            raise ValueError(f"kv_slots must be >= 1, got {self.kv_slots}")
        if self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {self.prefill_tokens}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
