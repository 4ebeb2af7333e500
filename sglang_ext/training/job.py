"""The training driver: every `moa-serve train` command runs through `run(TrainConfig)`.

    moa-serve train eagle3 --data sharegpt --out runs/eagle3                      one head
    moa-serve train job --shards data/shards --out runs/job --time-budget-min 7    EAGLE-3, MoA TLI=0 and 1 together
    moa-serve train job --smoke --device cpu                                       CPU, seconds (synthetic data)
    torchrun --standalone --nproc-per-node 2 -m moa_serve.entrypoints.cli train job ...      data parallel over 2 ranks
    python -m moa_serve.entrypoints.train_job ...      `train job` where only torch is installed (a GPU machine)

Every head sees the same batches and the same target run (one target forward per step), so they
are compared at equal training tokens. Data (sources.py): conversations tokenised with the target's
chat template or token shards (`moa-serve train pack`); the target's own answers (sources named
`distill:*`) are repeated `--distill-repeat` times per epoch, since what a drafter must predict is the
target, and the draft vocab (shared by the heads) is their most frequent tokens. A fraction
(--holdout) of each source is held out and scored at the end.

Under torchrun every rank loads the target and forms the same global batches; each trains on its rows
of them and the heads' gradients are summed (parallel.py): N ranks train as one would on the same
global batch. Rank 0 alone logs, checkpoints, scores the held-out batches and writes the outputs.

Writes under --out: `checkpoints/step_<n>/` and `latest` (--resume continues from them: weights,
optimizers, schedule, data position, random states), `metrics.jsonl` and TensorBoard (`tb/`),
`heads/<name>/` (bf16 servable checkpoints, shards <= 15 MiB), `curves.json` (per head: step, tokens,
loss, acc by draft step) and `summary.json`. `--pack DIR` also bundles heads + curves + summary into
`heads.tar.partNN` files of <= 15 MiB (what a GPU machine can send back). `--smoke` swaps the target
for a small random one of the same family and runs a few steps: the very same code path, for the CPU
test suite.
"""

from __future__ import annotations

import json
import sys
import tarfile
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import parallel
from .config import HEADS, TrainConfig, TrainError, head_kind, head_options

PART_BYTES = 15 * 2**20
EXPORT_RESERVE_S = 20.0
HELD_OUT_BATCHES = 8

__all__ = ["HEADS", "TrainConfig", "TrainError", "run"]


def _log(msg: str) -> None:
    print(f"[job {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def smoke_target(vocab_size: int, device: torch.device, seed: int = 0):
    """The --smoke target (models/synthetic.py): bf16 on an accelerator, as the real run."""
    from ..models.synthetic import random_target, smoke_config

    return random_target(
        smoke_config(vocab_size), device, torch.bfloat16 if device.type != "cpu" else torch.float32, seed
    )


def load_run_target(cfg: TrainConfig, device: torch.device, vocab_size: int | None):
    """(model, tokenizer, path): a GGUF file (converted once into cfg.cache), a name / directory, or with --smoke
    a random target of the data's vocab (no tokenizer, no path)."""
    from ..models import load_target
    from ..models.checkpoint import has_config
    from ..models.loader import convert_gguf

    if cfg.smoke:
        if vocab_size is None:
            raise TrainError("--smoke trains on token shards or synthetic data, not conversations (no tokenizer)")
        return smoke_target(vocab_size, device, cfg.seed), None, None
    path = cfg.target
    if cfg.target_gguf:
        out = Path(cfg.cache) / Path(cfg.target_gguf).stem
        if not has_config(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(Path(cfg.target_gguf), out)
        path = str(out)
    target = load_target(path, dtype=cfg.target_dtype, device=str(device))
    return target.model, target.tokenizer, target.path


def shipped_init(heads: tuple[str, ...], target_path) -> dict[str, Path]:
    """--init-from shipped: each head starts from the drafter shipped for the target (a variant from its base
    head's), or a TrainError naming the head that has none."""
    from types import SimpleNamespace

    from ..drafters.shipped import shipped_path

    if target_path is None:
        raise TrainError("--init-from shipped needs a real target (no shipped heads for --smoke's random one)")
    target = SimpleNamespace(path=target_path)
    return {h: shipped_path(target, h.split("@", 1)[0], error=TrainError) for h in heads}


def build_tasks(
    target,
    hot_ids: torch.Tensor,
    heads: tuple[str, ...],
    moa_loss: dict | None = None,
    seed: int = 0,
    init_from: Path | dict[str, Path] | None = None,
    cfg: TrainConfig | None = None,
) -> list:
    """One task per head, all on the target's device, the draft vocab shared; with init_from, heads
    start from the checkpoints `init_from/<head>` (or init_from itself for one head; or init_from[head]:
    fine-tuning, their own vocab and weights). Head options come from cfg and the head's variant (config.head_options);
    moa_loss overrides the run's MoA options under them."""
    cfg = cfg or TrainConfig(out="", heads=heads)
    if moa_loss:
        cfg = replace(cfg, moa=replace(cfg.moa, **moa_loss))
    tasks = []
    for head in heads:
        kind, tli = head_kind(head)
        opts, lr = head_options(head, cfg)
        torch.manual_seed(seed)
        source = _init_source(init_from, head, len(heads))
        draft = _load_head(kind, tli, source, target, opts) if source else _new_head(kind, tli, target, hot_ids, opts)
        task = _task(kind, target, draft, opts, seed)
        task.name, task.lr = head, lr
        tasks.append(task)
    return tasks


def _init_source(init_from: Path | dict[str, Path] | None, head: str, n_heads: int) -> Path | None:
    """The checkpoint a head starts from: None (a fresh head), init_from[head], or one found under a directory."""
    if init_from is None or isinstance(init_from, dict):
        return None if init_from is None else init_from[head]
    return _init_dir(init_from, head, n_heads)


def _init_dir(init_from: Path, head: str, n_heads: int) -> Path:
    """The checkpoint a head starts from: <init_from>/<head>, else (a variant) <init_from>/<its base head>,
    else init_from itself when it is the only head."""
    for name in (head, head.split("@", 1)[0]):
        if (init_from / name / "config.json").is_file():
            return init_from / name
    if n_heads == 1:
        return init_from
    raise TrainError(f"--init-from {init_from} has no {head}/ checkpoint")


def _load_head(kind: str, tli: int, source: Path, target, opts):
    """A head to fine-tune: its checkpoint's weights and draft vocab (a MoA one of the head's TLI, memory and
    SA layers)."""
    from ..models.eagle3 import load_eagle3
    from ..models.medusa import load_medusa
    from ..models.moa import load_moa

    load = {"eagle3": load_eagle3, "moa": load_moa, "medusa": load_medusa}[kind]
    draft = load(source, target.cfg)
    if kind == "moa" and opts.sa_layers > draft.cfg.sa_layers:
        draft = grow_sa_layers(draft, opts.sa_layers)
    if kind == "moa":
        want = (tli, "last_hidden" if opts.no_lsa else "lsa", opts.sa_layers)
        have = (draft.cfg.tli, draft.cfg.memory_source, draft.cfg.sa_layers)
        if have != want:
            raise TrainError(
                f"--init-from {source} has TLI={have[0]}, memory {have[1]}, {have[2]} SA layer(s); this run asks for "
                f"TLI={want[0]}, memory {want[1]}, {want[2]} SA layer(s)"
            )
    return draft.to(target.device)


def grow_sa_layers(draft, n: int):
    """A MoA head with n SA layers whose first ones are draft's: the added layers start as identities
    (their attention output and MLP down projections zero, so each adds nothing to its residual stream),
    so the grown head computes exactly what draft did and training adds the capacity from there."""
    from ..models.moa import MoADraft

    grown = MoADraft(replace(draft.cfg, sa_layers=n)).to(draft.hot_ids.device)
    missing, unexpected = grown.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("more_self_attention.") for k in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in grown.more_self_attention[draft.cfg.sa_layers - 1 :]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown


def _new_head(kind: str, tli: int, target, hot_ids: torch.Tensor, opts):
    """A freshly initialised head, made where it trains (no host copy of every weight)."""
    from ..models.eagle3 import Eagle3Config, Eagle3Draft
    from ..models.medusa import MedusaConfig, MedusaHeads
    from ..models.moa import MoAConfig, MoADraft

    hot = hot_ids.to(target.device)
    with torch.device(target.device):
        if kind == "eagle3":
            draft = Eagle3Draft(Eagle3Config.for_target(target.cfg, hot.numel(), opts.aux_layers))
        elif kind == "medusa":
            draft = MedusaHeads(MedusaConfig.for_target(target.cfg, opts.num_heads, hot.numel()))
        else:
            sa = "self" if opts.staircase_max >= 1.0 else "ancestors"  # inference runs the mask training ends with
            memory = "last_hidden" if opts.no_lsa else "lsa"
            vocab = hot.numel() if hot.numel() < target.cfg.vocab_size else 0
            draft = MoADraft(MoAConfig.for_target(target.cfg, tli, vocab, sa, memory, opts.sa_layers))
    if draft.hot_ids.numel() == hot.numel():
        draft.set_vocab(hot)
    if kind == "eagle3" and opts.init_head_from_target:
        with torch.no_grad():  # lm_head rows and final norm start from the target's
            draft.lm_head.weight.copy_(target.lm_head[hot].float())
            draft.norm.weight.copy_(target.norm.float())
    return draft


def _task(kind: str, target, draft, opts, seed: int):
    from .eagle3 import Eagle3Task
    from .medusa import MedusaTask
    from .moa import MoATask

    if kind == "eagle3":
        return Eagle3Task(target, draft, opts.ttt_length, opts.decay)
    if kind == "medusa":
        return MedusaTask(target, draft, opts.decay)
    return MoATask(
        target,
        draft,
        opts.lambda_kl,
        opts.lambda_feat,
        opts.min_gap,
        opts.max_gap,
        opts.staircase_ramp,
        opts.staircase_max,
        seed=seed,
        position_decay=opts.position_decay,
    )


def preflight(trainer, batches) -> None:
    """Each head's loss and backward once on the largest global batch (this rank's part of it; no optimizer
    step): a head that fails on any rank is dropped with its traceback on every rank, so one broken head
    cannot cost the others their run."""
    i = max(range(len(batches)), key=lambda j: (batches[j].input_ids.numel(), batches[j].input_ids.shape[1]))
    big = trainer.batches[i]
    tout = trainer.runner.run(big, trainer.capture_layers, keep_kv=trainer.needs_kv)
    ok = []
    for task in trainer.tasks:
        try:
            task.loss(big, tout, 0.0)[0].backward()
            ok.append(True)
        except Exception:
            _log(f"head {task.name} failed its first step and is dropped:\n{traceback.format_exc()}")
            ok.append(False)
        task.module.zero_grad(set_to_none=True)
    ok = parallel.all_agree(trainer.world, ok, trainer.device)
    if not any(ok):
        raise RuntimeError("every head failed its first step")
    trainer.tasks = [t for t, keep in zip(trainer.tasks, ok) if keep]
    trainer.opts = [o for o, keep in zip(trainer.opts, ok) if keep]
    del tout
    if trainer.device.type == "cuda" and trainer.world.main:
        torch.cuda.synchronize()
        _log(f"preflight: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def evaluate(trainer, batches) -> dict[str, dict[str, float]]:
    """Mean metrics of each head over held-out batches (no grad), to 8 significant digits."""
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
    return {n: {k: float(f"{v:.8g}") for k, v in m.items()} for n, m in sums.items()}


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
        raise TrainError(f"no heads.tar.part* in {parts_dir}")
    tar_path = dest / "heads.tar"
    dest.mkdir(parents=True, exist_ok=True)
    tar_path.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()


def run(cfg: TrainConfig) -> dict:
    """Train cfg's heads; under torchrun as one of several ranks. Returns the summary (rank 0's; {} on the others).
    Inputs that cannot run are a TrainError (or DataError / ValueError) before any weights are read."""
    from ..models import resolve_device

    t0 = time.time()
    cfg = cfg.checked()
    world = parallel.from_env()
    device = torch.device(world.device(resolve_device(cfg.device)))  # (cuda without CUDA: a ValueError)
    cfg = _smoked(cfg, device) if cfg.smoke else cfg
    _check_out(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    parallel.start(world, device)
    try:
        summary = _run(cfg, world, device, t0)
        parallel.settle(world)  # every rank done before the group goes down (gloo's teardown races a straggler)
        return summary
    finally:
        parallel.stop()


def _run(cfg: TrainConfig, world: parallel.World, device: torch.device, t0: float) -> dict:
    from ..models.eagle3 import vocab_from_counts
    from .data import make_batches
    from .sources import data_vocab, load_sources, split_examples, vocab_counts

    vocab = data_vocab(cfg)
    target, tokenizer, target_path = load_run_target(cfg, device, vocab)
    if vocab is not None and target.cfg.vocab_size != vocab:
        raise TrainError(f"shards were made for a vocab of {vocab}, the target has {target.cfg.vocab_size}")
    by_source = load_sources(cfg, tokenizer, _run_dir(cfg))
    counts = vocab_counts(cfg, by_source, target.cfg.vocab_size, tokenizer)
    size = min(cfg.draft_vocab_size or target.cfg.vocab_size, target.cfg.vocab_size)
    hot = vocab_from_counts(counts, size)
    coverage = float(counts[hot].sum()) / max(1, int(counts.sum()))
    train, held = split_examples(by_source, cfg)
    batches = make_batches(train, cfg.tokens_per_batch, cfg.seed)
    held_batches = make_batches(held, cfg.tokens_per_batch, cfg.seed)[:HELD_OUT_BATCHES] if held else []
    if cfg.init_from == "shipped":
        init = shipped_init(cfg.heads, target_path)
    else:
        init = Path(cfg.init_from) if cfg.init_from else None
    tasks = build_tasks(target, hot, cfg.heads, None, cfg.seed, init, cfg)
    for t in tasks if cfg.autocast is not None else ():
        t.autocast = cfg.autocast
    meta = _meta(cfg, world, device, hot, coverage)
    if world.main:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    trainer = _trainer(cfg, world, device, tasks, target, batches, meta, t0)
    n_tok = sum(b.num_tokens for b in batches)
    if world.main:
        _log(
            f"{device} x {world.size}: {len(batches)} batches, {n_tok} tokens per epoch, heads {cfg.heads}, draft "
            f"vocab {hot.numel()} (covers {coverage:.4f}), {trainer.run_cfg.total_steps} steps, prep "
            f"{time.time() - t0:.0f}s"
        )
    t1 = time.time()
    final = trainer.fit()
    if not world.main:
        return {}
    return _finish(cfg, trainer, held_batches, final, n_tok, time.time() - t1, t0)


def _check_out(cfg: TrainConfig) -> None:
    """A fresh run does not write into another run's directory (its checkpoints would mix with this one's); a
    --smoke run starts over in its own."""
    from .trainer import checkpoint_state

    latest = Path(cfg.out) / "latest"
    if cfg.resume is None and not cfg.smoke and latest.is_file():
        raise TrainError(
            f"{cfg.out} holds a run (latest: {latest.read_text().strip()}): pass --resume to continue it, or choose "
            "another --out"
        )
    if cfg.resume and checkpoint_state(Path(cfg.resume)) is None:  # (resuming --out itself may start afresh)
        raise TrainError(f"--resume {cfg.resume}: no checkpoint there (no latest, no trainer_state.pt)")


def _run_dir(cfg: TrainConfig) -> Path:
    """The directory of the run this one continues (its examples cache), else --out."""
    if not cfg.resume:
        return Path(cfg.out)
    src = Path(cfg.resume)
    return src.parent.parent if (src / "trainer_state.pt").is_file() else src


def _smoked(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """--smoke: tiny batches, a few steps, a tenth of each source held out; no time budget (the steps decide);
    fp32 heads on a CPU (bf16 matmuls round differently per batch shape: runs on 1 and N ranks compare exactly)."""
    return replace(
        cfg,
        autocast=False if device.type == "cpu" and cfg.autocast is None else cfg.autocast,
        tokens_per_batch=min(cfg.tokens_per_batch, 512),
        max_len=min(cfg.max_len, 64),
        max_steps=min(cfg.max_steps or 3, 3),
        draft_vocab_size=min(cfg.draft_vocab_size, 256),
        log_every=1,
        max_examples=min(cfg.max_examples or 64, 64),
        holdout=max(cfg.holdout, 0.1),
        time_budget_min=None,
        deadline_min=None,
    )


def _meta(cfg: TrainConfig, world: parallel.World, device: torch.device, hot: torch.Tensor, coverage: float) -> dict:
    """What the trainer records with its checkpoints and metrics."""
    return {
        "heads": list(cfg.heads),
        "target": cfg.target_gguf or cfg.target,
        "data": list(cfg.data),
        "tokens_per_batch": cfg.tokens_per_batch,
        "max_len": cfg.max_len,
        "lr": cfg.lr,
        "distill_repeat": cfg.distill_repeat,
        "draft_vocab_size": int(hot.numel()),
        "draft_vocab_coverage": round(coverage, 5),
        "device": _device_name(device),
        "world_size": world.size,
        "time_budget_min": cfg.time_budget_min,
        "seed": cfg.seed,
        "smoke": cfg.smoke,
        "init_from": cfg.init_from,
    }


def _trainer(cfg: TrainConfig, world, device: torch.device, tasks, target, batches, meta: dict, t0: float):
    """The Trainer of all heads, checked on a first batch (preflight) and resumed when asked; with
    --deadline-min its time budget is what is left of the run's wall time (since t0), less a reserve
    for export and scoring (rank 0's reading, so every rank stops at the same step)."""
    from .target import TargetRunner
    from .trainer import OptimConfig, RunConfig, Trainer

    run_cfg = RunConfig(
        cfg.out,
        cfg.max_steps or max(1, int(cfg.epochs * len(batches))),
        save_every_s=cfg.save_every_min * 60,
        keep_checkpoints=cfg.keep_checkpoints,
        log_every=cfg.log_every,
        time_budget_s=cfg.time_budget_min * 60 if cfg.time_budget_min else None,
        seed=cfg.seed,
        progress_bar=cfg.progress,
        stop_step=cfg.stop_at_step,
        save_every_steps=cfg.save_every_steps,
    )
    # the CPU runs the batch's sequences unpadded: a whole example may exceed tokens_per_batch
    runner = TargetRunner(target, max(cfg.tokens_per_batch, cfg.max_len if device.type == "cpu" else 0))
    optim = OptimConfig(
        lr=cfg.lr, warmup_ratio=cfg.warmup_ratio, grad_clip=cfg.grad_clip, weight_decay=cfg.weight_decay
    )
    trainer = Trainer(tasks, runner, batches, optim, run_cfg, meta, world)
    preflight(trainer, batches)
    if cfg.deadline_min:
        left = parallel.agree(world, cfg.deadline_min * 60 - (time.time() - t0) - EXPORT_RESERVE_S, device)
        budget = min(run_cfg.time_budget_s or float("inf"), left)
        trainer.run_cfg = replace(run_cfg, time_budget_s=max(1.0, budget))
    if cfg.resume is not None:
        _resume(cfg, trainer, world)
    return trainer


def _resume(cfg: TrainConfig, trainer, world: parallel.World) -> None:
    """Continue from --resume DIR (a run or a checkpoint directory; '' is --out, where a run without a
    checkpoint yet starts from the beginning)."""
    src = Path(cfg.resume or cfg.out)
    if trainer.resume(src) and world.main:
        _log(f"resumed at step {trainer.step} ({trainer.tokens_seen} tokens) from {src}")


def _finish(cfg: TrainConfig, trainer, held_batches, final: dict, epoch_tokens: int, train_s: float, t0: float) -> dict:
    """Rank 0: the servable heads, the held-out scores, curves.json, summary.json (and the parts with --pack)."""
    out = Path(cfg.out)
    heads = [t.name for t in trainer.tasks]
    trainer.export(out / "heads" if len(heads) > 1 else out / "heads" / heads[0])
    summary = {
        "device": trainer.meta["device"],
        "world_size": trainer.world.size,
        "heads": heads,
        "steps": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "train_seconds": round(train_s, 1),
        "tokens_per_s": round(trainer.tokens_seen / max(train_s, 1e-9)),
        "epoch_tokens": epoch_tokens,
        "final_train": {k: round(v, 5) for k, v in final.items()},
        "held_out": evaluate(trainer, held_batches) if held_batches else {},
        "total_seconds": round(time.time() - t0, 1),
    }
    (out / "curves.json").write_text(json.dumps(curves(out / "metrics.jsonl", heads)) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if cfg.pack:
        pack_outputs(out, Path(cfg.pack))
    _log(json.dumps(summary))
    return summary


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
