"""The one trainer for every draft type (EAGLE-3 now, MoA next).

A model type is a *task* object:

    task.module                      nn.Module with the trainable parameters
    task.capture_layers              target layers whose outputs the task reads
    task.loss(batch, target_out, progress) -> (loss, metrics)   progress in [0, 1)
    task.save(dir, extra_config)     writes the servable checkpoint (config.json + model.safetensors)

The trainer owns the target run (no grad), AdamW with linear warmup + cosine decay, gradient
clipping, tqdm/TensorBoard/JSONL logging and checkpoints. A checkpoint directory
`<out>/checkpoints/step_<n>/` holds the servable export plus `trainer_state.pt` (fp32 weights,
optimizer, scheduler, step) for exact resumption; `<out>/latest` names the newest one.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

from .data import Batch
from .target import TargetOutputs, TargetRunner


class Task(Protocol):
    name: str
    capture_layers: tuple[int, ...]

    @property
    def module(self) -> torch.nn.Module: ...

    def loss(self, batch: Batch, tout: TargetOutputs, progress: float) -> tuple[torch.Tensor, dict[str, float]]: ...

    def save(self, out_dir: str | Path, extra_config: dict | None = None) -> None: ...


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.015
    min_lr_ratio: float = 0.05
    grad_clip: float = 0.5


@dataclass(frozen=True)
class RunConfig:
    out_dir: str
    total_steps: int
    save_every_s: float = 300.0
    keep_checkpoints: int = 3
    log_every: int = 1
    time_budget_s: float | None = None  # stop when training time reaches this; the LR schedule follows time too
    seed: int = 0
    progress_bar: bool = True
    stop_step: int | None = None  # end here without changing the schedule (ablations matched to another run's step)


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    """Linear warmup over the first `warmup` fraction of training, then cosine down to min_ratio."""
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    frac = (progress - warmup) / max(1e-9, 1 - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def counted_seconds(dt: float, recent: list[tuple[float, int]], tokens: int, window: int = 50) -> float:
    """The training time a step counts for the time budget and the LR schedule.

    NOTE: a step that took over 10x the recent median seconds-per-token was suspended (SIGSTOP while
    a benchmark had the machine) or starved; it counts at the median rate, so a pause does not eat
    the budget or jump the schedule. `recent` holds the last `window` (seconds, tokens) pairs."""
    if len(recent) >= 5:
        rates = sorted(s / max(1, n) for s, n in recent)
        typical = rates[len(rates) // 2] * max(1, tokens)
        if dt > 10 * typical:
            dt = typical
    recent.append((dt, tokens))
    del recent[:-window]
    return dt


class Trainer:
    def __init__(self, task: Task, target_runner: TargetRunner, batches: list[Batch], optim: OptimConfig, run: RunConfig, meta: dict | None = None):
        if not batches:
            raise ValueError("no training batches")
        self.task, self.runner, self.batches = task, target_runner, batches
        self.optim_cfg, self.run_cfg, self.meta = optim, run, meta or {}
        self.out = Path(run.out_dir)
        params = [p for p in task.module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_s = 0.0

    # --- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        ckpt = self.out / "checkpoints" / f"step_{self.step}"
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        extra = {"training": {**self.meta, "step": self.step, "tokens_seen": self.tokens_seen, "train_seconds": round(self.elapsed_s)}}
        self.task.save(tmp, extra_config=extra)
        state = {
            "module": self.task.module.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_s,
            "optim": asdict(self.optim_cfg),
        }
        torch.save(state, tmp / "trainer_state.pt")
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)
        (self.out / "latest.tmp").write_text(ckpt.name + "\n")
        (self.out / "latest.tmp").replace(self.out / "latest")
        self._prune()
        return ckpt

    def _prune(self) -> None:
        ckpts = sorted((self.out / "checkpoints").glob("step_*[0-9]"), key=lambda p: int(p.name.split("_")[1]))
        for old in ckpts[: -self.run_cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> bool:
        """Continue from <out>/latest if it exists; returns whether it did."""
        latest = self.out / "latest"
        if not latest.is_file():
            return False
        state = torch.load(self.out / "checkpoints" / latest.read_text().strip() / "trainer_state.pt", map_location="cpu", weights_only=False)
        self.task.module.load_state_dict(state["module"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.tokens_seen, self.elapsed_s = state["step"], state["tokens_seen"], state["elapsed_s"]
        return True

    # --- loop ---------------------------------------------------------------------------------
    def batch_at(self, step: int) -> Batch:
        """Epoch e visits the batches in a seeded permutation of its own (deterministic on resume)."""
        n = len(self.batches)
        epoch, i = divmod(step, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.run_cfg.seed + epoch))
        return self.batches[int(perm[i])]

    def train_step(self, batch: Batch) -> dict[str, float]:
        module = self.task.module
        module.train()
        tout = self.runner.run(batch, self.task.capture_layers)
        progress = self.progress
        lr = self.optim_cfg.lr * lr_factor(progress, self.optim_cfg.warmup_ratio, self.optim_cfg.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss, metrics = self.task.loss(batch, tout, progress)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(module.parameters(), self.optim_cfg.grad_clip)
        self.opt.step()
        metrics["grad_norm"] = float(gnorm)
        metrics["lr"] = lr
        return metrics

    @property
    def progress(self) -> float:
        """Fraction of training done: by steps, or by time when a time budget is set (whichever is further)."""
        rc = self.run_cfg
        p = self.step / rc.total_steps
        if rc.time_budget_s:
            p = max(p, self.elapsed_s / rc.time_budget_s)
        return min(p, 1.0)

    @property
    def done(self) -> bool:
        rc = self.run_cfg
        return self.step >= rc.total_steps or self.progress >= 1.0 or (rc.stop_step is not None and self.step >= rc.stop_step)

    def fit(self) -> dict[str, float]:
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        rc = self.run_cfg
        self.out.mkdir(parents=True, exist_ok=True)
        tb = SummaryWriter(str(self.out / "tb"))
        log = open(self.out / "metrics.jsonl", "a")
        bar = tqdm(total=rc.total_steps, initial=self.step, disable=not rc.progress_bar, dynamic_ncols=True, mininterval=5)
        last_save, metrics, recent = time.monotonic(), {}, []
        try:
            while not self.done:
                batch = self.batch_at(self.step)
                t0 = time.perf_counter()
                metrics = self.train_step(batch)
                dt = counted_seconds(time.perf_counter() - t0, recent, batch.num_tokens)
                self.step += 1
                self.tokens_seen += batch.num_tokens
                self.elapsed_s += dt
                metrics.update(tokens_per_s=batch.num_tokens / dt, tokens_seen=self.tokens_seen)
                self._log(tb, log, bar, metrics)
                if time.monotonic() - last_save >= rc.save_every_s:
                    self.save()
                    last_save = time.monotonic()
            self.save()
        finally:
            bar.close()
            tb.close()
            log.close()
        return metrics

    def _log(self, tb, log, bar, m: dict[str, float]) -> None:
        bar.update(1)
        if self.step % self.run_cfg.log_every:
            return
        for k, v in m.items():
            tb.add_scalar(f"train/{k}", v, self.step)
        log.write(json.dumps({"step": self.step, "time": round(self.elapsed_s, 1), **{k: round(v, 5) for k, v in m.items()}}) + "\n")
        log.flush()
        bar.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m.get('acc_0', 0):.3f}", tok_s=f"{m['tokens_per_s']:.0f}", refresh=False)
