"""The drafter training job: EAGLE-3, MoA TLI=0 and MoA TLI=1 trained together on one GPU.

    moa-serve train job --shards data/shards --target smollm2 --out runs/job --time-budget-min 7
    moa-serve train job --shards data/shards --out runs/smoke --smoke      # CPU, seconds
    python -m entrypoints.train_job ...      # the same, where only torch is installed (a GPU machine)

Every head sees the same batches and the same target run (one target forward per step), so they
are compared at equal training tokens. Data: token shards (`moa-serve train pack`); the target's own
answers (sources named `distill:*`) are repeated `--distill-repeat` times per epoch, since what a
drafter must predict is the target. The draft vocab (shared by the heads) is the most frequent tokens
of those answers. A few batches are held out and scored at the end.

Writes under --out: `heads/<name>/` (bf16 servable checkpoints, shards <= 15 MiB), `train/` (trainer
checkpoints, metrics.jsonl, TensorBoard), `curves.json` (per head: step, tokens, loss, acc by draft
step), `summary.json`. `--pack DIR` also bundles heads + curves + summary into `heads.tar.partNN`
files of <= 15 MiB (what a GPU machine can send back). `--smoke` swaps the target for a small random
one of the same family and runs a few steps: the very same code path, for the CPU test suite.
"""

from __future__ import annotations

import json
import random
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

HEADS = ("eagle3", "moa-tli0", "moa-tli1")
PART_BYTES = 15 * 2**20
EXPORT_RESERVE_S = 20.0


@dataclass(frozen=True)
class JobConfig:
    """Everything the job needs (flags: entrypoints/train_job.py)."""

    shards: str  # token shard directory (moa-serve train pack)
    out: str
    target: str = "smollm2"  # 'smollm2' or a local HF directory
    target_gguf: str | None = None  # a GGUF file of the target (converted once into `cache`)
    cache: str = "/tmp/moa-serve-job-cache"
    pack: str | None = None  # also write heads.tar.partNN (<= 15 MiB each) here
    heads: tuple[str, ...] = HEADS
    init_from: str | None = None  # fine-tune: start each head from <dir>/<head> (its weights and draft vocab)
    device: str = "auto"  # auto | cpu | cuda
    time_budget_min: float = 7.0  # training time; the LR schedule follows it
    deadline_min: float | None = None  # wall time of the whole job: training stops in time to export and score
    max_steps: int = 1_000_000
    tokens_per_batch: int = 32768
    max_len: int = 1024
    draft_vocab_size: int = 8192
    distill_repeat: int = 3
    max_examples: int | None = None  # at most this many examples (windows) per source
    holdout: float = 0.005  # fraction of each source held out for the final scores
    lr: float = 1e-3
    warmup_ratio: float = 0.03
    log_every: int = 20
    seed: int = 0
    smoke: bool = False  # small random target, tiny batches, a few steps (CPU test)


class JobError(ValueError):
    """The job's inputs cannot run (unknown head, shards for another vocabulary, no parts to unpack)."""


def _log(msg: str) -> None:
    print(f"[job {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def smoke_config(vocab_size: int):
    """SmolLM2's family (tied embeddings, GQA) at a fraction of its size, with the data's vocab."""
    from ..models.loader import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position=2048,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=(2,),
    )


def random_target(cfg, device: torch.device | str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A Llama of cfg's shape with random weights (tied embeddings, no biases)."""
    from ..models.llama import LlamaModel

    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    shapes = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    state = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g),
        "model.norm.weight": torch.ones(h),
    }
    for i in range(cfg.num_layers):
        for name, shape in shapes.items():
            state[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h)
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(h)
    return LlamaModel(cfg, state, dtype=dtype, device=device)


def smoke_target(vocab_size: int, device: torch.device, seed: int = 0):
    """The --smoke target: bf16 on an accelerator, as the real run."""
    return random_target(
        smoke_config(vocab_size), device, torch.bfloat16 if device.type != "cpu" else torch.float32, seed
    )


def load_job_target(job: JobConfig, device: torch.device):
    """The target model: a GGUF file (converted once into --cache), a name/dir, or the smoke target."""
    from ..models import load_target
    from ..models.checkpoint import has_config
    from ..models.loader import _convert_gguf

    if job.target_gguf:
        out = Path(job.cache) / Path(job.target_gguf).stem
        if not has_config(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(Path(job.target_gguf), out)
        return load_target(str(out), dtype="auto", device=str(device)).model
    return load_target(job.target, dtype="auto", device=str(device)).model


def draft_vocab(examples_by_source: dict[str, list], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent assistant tokens of the target's own answers (all sources if none)."""
    from ..models.eagle3 import vocab_from_counts
    from .data import token_counts

    own = [e for name, exs in examples_by_source.items() if name.startswith("distill") for e in exs]
    pool = own or [e for exs in examples_by_source.values() for e in exs]
    return vocab_from_counts(token_counts(pool, vocab_size), min(size, vocab_size))


def build_tasks(
    target, hot_ids: torch.Tensor, heads: tuple[str, ...], moa_loss: dict, seed: int = 0, init_from: Path | None = None
) -> list:
    """One task per head, all on the target's device, the draft vocab shared; with init_from, heads
    start from the checkpoints `init_from/<head>` (fine-tuning: their own vocab and weights)."""
    from ..models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3
    from ..models.moa import MoAConfig, MoADraft, load_moa
    from .eagle3 import Eagle3Task
    from .moa import MoATask

    tasks = []
    for head in heads:
        if head not in HEADS:
            raise JobError(f"unknown head {head!r}; choose from {HEADS}")
        torch.manual_seed(seed)
        if init_from is not None:
            load = load_eagle3 if head == "eagle3" else load_moa
            draft = load(init_from / head, target.cfg).to(target.device)
            task = Eagle3Task(target, draft) if head == "eagle3" else MoATask(target, draft, seed=seed, **moa_loss)
            tasks.append(task)
            continue
        with torch.device(target.device):  # made where they train: no host copy of every weight
            if head == "eagle3":
                draft = Eagle3Draft(Eagle3Config.for_target(target.cfg, hot_ids.numel()))
            else:
                draft = MoADraft(
                    MoAConfig.for_target(
                        target.cfg, tli=int(head.removeprefix("moa-tli")), draft_vocab_size=hot_ids.numel()
                    )
                )
        draft.set_vocab(hot_ids.to(target.device))
        if head == "eagle3":
            with torch.no_grad():  # lm_head rows and final norm start from the target's
                draft.lm_head.weight.copy_(target.lm_head[hot_ids.to(target.device)].float())
                draft.norm.weight.copy_(target.norm.float())
            tasks.append(Eagle3Task(target, draft))
        else:
            tasks.append(MoATask(target, draft, seed=seed, **moa_loss))
    return tasks


def split_examples(examples_by_source: dict[str, list], distill_repeat: int, holdout: float, seed: int):
    """-> training examples (the target's answers repeated), held-out examples (a seeded sample of each source)."""
    rng = random.Random(seed)
    train, held = [], []
    for name, exs in examples_by_source.items():
        exs = list(exs)
        rng.shuffle(exs)
        k = max(1, int(len(exs) * holdout)) if len(exs) > 1 else 0
        held += exs[:k]
        train += exs[k:] * (distill_repeat if name.startswith("distill") else 1)
    return train, held


def preflight(trainer, batches) -> None:
    """Each head's loss and backward once on the largest padded batch (no optimizer step): a head
    that fails is dropped with its traceback, so one broken head cannot cost the others their run."""
    big = max(batches, key=lambda b: (b.input_ids.numel(), b.input_ids.shape[1])).to(trainer.runner.device)
    tout = trainer.runner.run(big, trainer.capture_layers, keep_kv=trainer.needs_kv)
    keep = []
    for task, opt in zip(trainer.tasks, trainer.opts):
        try:
            task.loss(big, tout, 0.0)[0].backward()
            keep.append((task, opt))
        except Exception:
            _log(f"head {task.name} failed its first step and is dropped:\n{traceback.format_exc()}")
        task.module.zero_grad(set_to_none=True)
    if not keep:
        raise RuntimeError("every head failed its first step")
    trainer.tasks, trainer.opts = [t for t, _ in keep], [o for _, o in keep]
    del tout
    if trainer.runner.device.type == "cuda":
        torch.cuda.synchronize()
        _log(f"preflight: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def evaluate(trainer, batches) -> dict[str, dict[str, float]]:
    """Mean metrics of each head over held-out batches (no grad)."""
    sums: dict[str, dict[str, float]] = {t.name: {} for t in trainer.tasks}
    with torch.no_grad():
        for b in batches:
            b = b.to(trainer.runner.device)
            tout = trainer.runner.run(b, trainer.capture_layers, keep_kv=trainer.needs_kv)
            for t in trainer.tasks:
                t.module.eval()
                _, m = t.loss(b, tout, 1.0)
                for k, v in m.items():
                    sums[t.name][k] = sums[t.name].get(k, 0.0) + float(v) / len(batches)
    return {n: {k: round(v, 5) for k, v in m.items()} for n, m in sums.items()}


def curves(metrics_file: Path, heads: list[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {h: [] for h in heads}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for h in heads:
            pre = f"{h}/" if len(heads) > 1 else ""
            vals = {k.removeprefix(pre): v for k, v in row.items() if k.startswith(pre) and (pre or "/" not in k)}
            out[h].append(
                {
                    "step": row["step"],
                    "time": row["time"],
                    "tokens_seen": row["tokens_seen"],
                    "tokens_per_s": row["tokens_per_s"],
                    **vals,
                }
            )
    return out


def pack_outputs(out: Path, dest: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """heads/, curves.json and summary.json as one tar split into parts of <= part_bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    tar_path = dest / "heads.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name in ("heads", "curves.json", "summary.json"):
            if (out / name).exists():
                tar.add(out / name, arcname=name)
    data = tar_path.read_bytes()
    tar_path.unlink()
    parts = []
    for i in range(0, len(data), part_bytes):
        parts.append(dest / f"heads.tar.part{i // part_bytes:02d}")
        parts[-1].write_bytes(data[i : i + part_bytes])
    return parts


def unpack_outputs(parts_dir: Path, dest: Path) -> None:
    """The inverse of pack_outputs."""
    parts = sorted(Path(parts_dir).glob("heads.tar.part*"))
    if not parts:
        raise JobError(f"no heads.tar.part* in {parts_dir}")
    tar_path = dest / "heads.tar"
    dest.mkdir(parents=True, exist_ok=True)
    tar_path.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()


def run(job: JobConfig) -> dict:
    from ..models import resolve_device
    from .shards import read_manifest

    t0 = time.time()
    if job.smoke:
        job = _smoked(job)
    device = torch.device(resolve_device(job.device))  # (cuda without CUDA: a ValueError, before any weights)
    manifest = read_manifest(job.shards)
    target = smoke_target(manifest["vocab_size"], device, job.seed) if job.smoke else load_job_target(job, device)
    if target.cfg.vocab_size != manifest["vocab_size"]:
        raise JobError(
            f"shards were made for a vocab of {manifest['vocab_size']}, the target has {target.cfg.vocab_size}"
        )
    hot, batches, held_batches = _job_data(job, target)
    heads = tuple(job.heads)
    init = Path(job.init_from) if job.init_from else None
    tasks = build_tasks(
        target, hot, heads, {"lambda_kl": 1.0, "lambda_feat": 0.1, "min_gap": 6, "max_gap": 14}, job.seed, init
    )
    out = Path(job.out)
    trainer = _job_trainer(job, device, tasks, target, batches, _job_meta(job, manifest, hot, device), t0)
    n_tok = sum(b.num_tokens for b in batches)
    _log(
        f"{device}: {len(batches)} batches, {n_tok} tokens per epoch, heads {heads}, draft vocab {hot.numel()}, prep "
        f"{time.time() - t0:.0f}s"
    )
    t1 = time.time()
    final = trainer.fit()
    train_s = time.time() - t1
    heads = tuple(t.name for t in trainer.tasks)
    trainer.export(out / "heads" if len(tasks) > 1 else out / "heads" / tasks[0].name)
    held_scores = evaluate(trainer, held_batches) if held_batches else {}
    summary = {
        "device": _device_name(device),
        "heads": list(heads),
        "steps": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "train_seconds": round(train_s, 1),
        "tokens_per_s": round(trainer.tokens_seen / max(train_s, 1e-9)),
        "epoch_tokens": n_tok,
        "final_train": {k: round(v, 5) for k, v in final.items()},
        "held_out": held_scores,
        "total_seconds": round(time.time() - t0, 1),
    }
    (out / "curves.json").write_text(json.dumps(curves(out / "train" / "metrics.jsonl", list(heads))) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if job.pack:
        pack_outputs(out, Path(job.pack))
    _log(json.dumps(summary))
    return summary


def _smoked(job: JobConfig) -> JobConfig:
    """--smoke: tiny batches and a few steps."""
    return replace(
        job,
        tokens_per_batch=min(job.tokens_per_batch, 512),
        max_len=min(job.max_len, 64),
        max_steps=min(job.max_steps, 3),
        draft_vocab_size=min(job.draft_vocab_size, 256),
        log_every=1,
        max_examples=min(job.max_examples or 64, 64),
    )


def _job_data(job: JobConfig, target) -> tuple[torch.Tensor, list, list]:
    """-> (draft vocab [V_draft] target ids, training batches, held-out batches (at most 8))."""
    from .data import make_batches
    from .shards import load_examples_by_source

    by_source = load_examples_by_source(job.shards, job.max_len, limit=job.max_examples)
    hot = draft_vocab(by_source, target.cfg.vocab_size, job.draft_vocab_size)
    train, held = split_examples(by_source, job.distill_repeat, job.holdout, job.seed)
    batches = make_batches(train, job.tokens_per_batch, job.seed)
    return hot, batches, make_batches(held, job.tokens_per_batch, job.seed)[:8]


def _job_meta(job: JobConfig, manifest: dict, hot: torch.Tensor, device: torch.device) -> dict:
    """What the trainer records with its checkpoints and metrics."""
    return {
        "job": "moa-serve train job",
        "shards": manifest.get("sources"),
        "tokens_per_batch": job.tokens_per_batch,
        "max_len": job.max_len,
        "lr": job.lr,
        "distill_repeat": job.distill_repeat,
        "draft_vocab_size": int(hot.numel()),
        "device": _device_name(device),
        "time_budget_min": job.time_budget_min,
        "smoke": bool(job.smoke),
        "init_from": job.init_from,
    }


def _job_trainer(job: JobConfig, device: torch.device, tasks, target, batches, meta: dict, t0: float):
    """The Trainer of all heads, checked on a first batch (preflight); with --deadline-min its time budget
    is what is left of the job's wall time (since t0), less a reserve for export and scoring."""
    from .target import TargetRunner
    from .trainer import OptimConfig, RunConfig, Trainer

    run_cfg = RunConfig(
        str(Path(job.out) / "train"),
        job.max_steps,
        save_every_s=1e9,
        keep_checkpoints=1,
        log_every=job.log_every,
        time_budget_s=job.time_budget_min * 60,
        seed=job.seed,
        progress_bar=False,
    )
    runner = TargetRunner(
        target, job.tokens_per_batch if device.type != "cpu" else max(job.tokens_per_batch, job.max_len)
    )
    trainer = Trainer(tasks, runner, batches, OptimConfig(lr=job.lr, warmup_ratio=job.warmup_ratio), run_cfg, meta)
    preflight(trainer, batches)
    if job.deadline_min:
        left = job.deadline_min * 60 - (time.time() - t0) - EXPORT_RESERVE_S
        trainer.run_cfg = replace(run_cfg, time_budget_s=max(1.0, min(run_cfg.time_budget_s, left)))
    return trainer


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
