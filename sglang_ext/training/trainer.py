"""The one trainer for every draft type (EAGLE-3, MoA).

A model type is a *task* object:

    task.name                        "eagle3", "moa-tli1", "moa-tli1@lambda_feat=0.3", ...
    task.lr                          optional: this task's peak learning rate (default OptimConfig.lr)
    task.module                      nn.Module with the trainable parameters
    task.capture_layers              target layers whose outputs the task reads
    task.needs_kv                    whether it reads the target's K/V (MoA)
    task.loss(batch, target_out, progress) -> (loss, metrics)   progress in [0, 1); metrics are tensors
    task.save(dir, extra_config)     writes the servable checkpoint (config.json + weights)

The trainer owns the target run (no grad), AdamW with linear warmup + cosine decay, gradient
clipping, tqdm/TensorBoard/JSONL logging and checkpoints. Several tasks can train at once on the
same batches and the same target run (one target forward per step, the same tokens for each: a
fair comparison at equal training tokens); each has its own optimizer, and with more than one
task metrics and exports are prefixed / placed by task name.

A checkpoint directory `<out>/checkpoints/step_<n>/` holds the servable export (one task) or one
export per task (`<n>/<task.name>/`), plus `trainer_state.pt` for exact resumption: fp32 weights,
optimizers, step (the data position and the LR schedule follow from it), tokens seen, training time
and the random states (torch's and each task's generator); `<out>/latest` names the newest one.
Checkpoints are written every `save_every_steps` steps and every `save_every_s` seconds, so a
stopped run loses at most one interval.

Data parallel (parallel.World with several ranks): every rank holds the same global batches, trains
on its rows of each (Batch.split) and sums the heads' gradients with the other ranks
(parallel.data_parallel_loss); metrics are summed the same way, so every rank sees the global
batch's. Only rank 0 logs and writes checkpoints; wall-clock readings that steer the schedule are
rank 0's (parallel.agree), so every rank stops at the same step.

On an accelerator the step never waits on the host: the batches live on the device, metrics stay
tensors, and the host reads them (one sync) only every `log_every` steps; time is measured between
those reads.
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
from .parallel import World, agree, data_parallel_loss
from .target import TargetOutputs, TargetRunner


class Task(Protocol):
    name: str
    capture_layers: tuple[int, ...]
    needs_kv: bool

    @property
    def module(self) -> torch.nn.Module: ...

    def loss(
        self, batch: Batch, tout: TargetOutputs, progress: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

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
    save_every_steps: int | None = None  # also a checkpoint every this many steps


def checkpoint_state(source: Path) -> Path | None:
    """trainer_state.pt of a checkpoint directory, or of the newest checkpoint of a run directory
    (<run>/latest); None when the run has none yet."""
    if (source / "trainer_state.pt").is_file():
        return source / "trainer_state.pt"
    latest = source / "latest"
    if not latest.is_file():
        if source.exists() and not source.is_dir():
            raise ValueError(f"{source} is not a run or checkpoint directory")
        return None
    path = source / "checkpoints" / latest.read_text().strip() / "trainer_state.pt"
    if not path.is_file():
        raise ValueError(f"{latest} names {path.parent.name}, which has no trainer_state.pt")
    return path


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
    def __init__(
        self,
        task: Task | list[Task],
        target_runner: TargetRunner,
        batches: list[Batch],
        optim: OptimConfig,
        run: RunConfig,
        meta: dict | None = None,
        world: World | None = None,
    ):
        """batches: the global batches (the same on every rank); this rank trains on its rows of each."""
        if not batches:
            raise ValueError("no training batches")
        self.tasks = list(task) if isinstance(task, (list, tuple)) else [task]
        if len({t.name for t in self.tasks}) != len(self.tasks):
            raise ValueError(f"tasks need distinct names, got {[t.name for t in self.tasks]}")
        self.runner = target_runner
        self.world = world or World()
        self.batches = [b.split(self.world.rank, self.world.size).to(target_runner.device) for b in batches]
        self.batch_tokens = [b.num_tokens for b in batches]  # of the global batches
        self._losses: dict[str, object] = {}  # task name -> its loss through DDP (several ranks)
        self.optim_cfg, self.run_cfg, self.meta = optim, run, meta or {}
        self.out = Path(run.out_dir)
        fused = {"fused": True} if target_runner.device.type == "cuda" else {}
        self.opts = [
            torch.optim.AdamW(
                [p for p in t.module.parameters() if p.requires_grad],
                lr=optim.lr,
                betas=optim.betas,
                weight_decay=optim.weight_decay,
                **fused,
            )
            for t in self.tasks
        ]
        self.capture_layers = tuple(sorted({l for t in self.tasks for l in t.capture_layers}))
        self.needs_kv = any(getattr(t, "needs_kv", True) for t in self.tasks)
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_s = 0.0

    @property
    def task(self) -> Task:
        return self.tasks[0]

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.opts[0]

    def _export_dir(self, root: Path, task: Task) -> Path:
        return root if len(self.tasks) == 1 else root / task.name

    # --- checkpoints --------------------------------------------------------------------------
    def training_record(self) -> dict:
        return {**self.meta, "step": self.step, "tokens_seen": self.tokens_seen, "train_seconds": round(self.elapsed_s)}

    def export(self, root: Path) -> None:
        """The servable checkpoint of every task under root."""
        for t in self.tasks:
            t.save(self._export_dir(root, t), extra_config={"training": self.training_record()})

    def save(self) -> Path | None:
        """A checkpoint of the current step (rank 0 writes it; the others have the same state)."""
        if not self.world.main:
            return None
        ckpt = self.out / "checkpoints" / f"step_{self.step}"
        tmp = ckpt.with_name(ckpt.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.export(tmp)
        state = {
            "module": [t.module.state_dict() for t in self.tasks],
            "optimizer": [o.state_dict() for o in self.opts],
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_s,
            "optim": asdict(self.optim_cfg),
            "rng": self._rng_state(),
        }
        if len(self.tasks) == 1:  # the single-task layout
            state["module"], state["optimizer"] = state["module"][0], state["optimizer"][0]
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

    def _rng_state(self) -> dict:
        """torch's generators and each task's own (MoA's verification points)."""
        cuda = self.runner.device.type == "cuda"
        gens = {t.name: t.gen for t in self.tasks if isinstance(getattr(t, "gen", None), torch.Generator)}
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.runner.device) if cuda else None,
            "tasks": {name: g.get_state() for name, g in gens.items()},
        }

    def _set_rng_state(self, rng: dict) -> None:
        """(generator states are host byte tensors, wherever the checkpoint was loaded to)"""
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] is not None and self.runner.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"].cpu(), self.runner.device)
        for t in self.tasks:
            if t.name in rng["tasks"]:
                t.gen.set_state(rng["tasks"][t.name].cpu())

    def resume(self, source: str | Path | None = None) -> bool:
        """Continue from a checkpoint: `source` is a run directory (its `latest`) or a checkpoint directory
        (default: this run's out_dir). Returns whether there was one to continue from."""
        path = checkpoint_state(Path(source) if source is not None else self.out)
        if path is None:
            return False
        state = torch.load(path, map_location=self.runner.device, weights_only=False)
        modules, optims = state["module"], state["optimizer"]
        if isinstance(modules, dict):  # the single-task layout
            modules, optims = [modules], [optims]
        if len(modules) != len(self.tasks):
            raise ValueError(f"{path} holds {len(modules)} heads; this run trains {[t.name for t in self.tasks]}")
        for t, o, m, os_ in zip(self.tasks, self.opts, modules, optims):
            t.module.load_state_dict(m)
            o.load_state_dict(os_)
        self.step, self.tokens_seen, self.elapsed_s = state["step"], state["tokens_seen"], state["elapsed_s"]
        if "rng" in state:
            self._set_rng_state(state["rng"])
        return True

    # --- loop ---------------------------------------------------------------------------------
    def batch_index(self, step: int) -> int:
        """Epoch e visits the batches in a seeded permutation of its own (deterministic on resume)."""
        n = len(self.batches)
        epoch, i = divmod(step, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.run_cfg.seed + epoch))
        return int(perm[i])

    def batch_at(self, step: int) -> Batch:
        return self.batches[self.batch_index(step)]

    def _loss_fn(self, task: Task):
        """task.loss, through DDP when there are several ranks (built at first use: preflight may drop tasks)."""
        if not self.world.parallel:
            return task.loss
        if task.name not in self._losses:
            self._losses[task.name] = data_parallel_loss(task)
        return self._losses[task.name]

    def train_step(self, batch: Batch) -> dict[str, torch.Tensor | float]:
        """One optimizer step of every task on batch (this rank's part of a global batch); metrics stay
        on the device and are the global batch's."""
        tout = self.runner.run(batch, self.capture_layers, keep_kv=self.needs_kv)
        progress = self.progress
        factor = lr_factor(progress, self.optim_cfg.warmup_ratio, self.optim_cfg.min_lr_ratio)
        out: dict[str, torch.Tensor | float] = {"lr": self.optim_cfg.lr * factor}
        for task, opt in zip(self.tasks, self.opts):
            task.module.train()
            for g in opt.param_groups:
                g["lr"] = (getattr(task, "lr", None) or self.optim_cfg.lr) * factor
            loss, metrics = self._loss_fn(task)(batch, tout, progress)
            if batch.part is not None:  # each rank's metrics are its share of the global batch's
                metrics = dict(zip(metrics, batch.total(torch.stack(list(metrics.values())))))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(
                task.module.parameters(), self.optim_cfg.grad_clip
            ).detach()
            opt.step()
            prefix = "" if len(self.tasks) == 1 else f"{task.name}/"
            out.update({prefix + k: v for k, v in metrics.items()})
        return out

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
        return (
            self.step >= rc.total_steps
            or self.progress >= 1.0
            or (rc.stop_step is not None and self.step >= rc.stop_step)
        )

    def fit(self) -> dict[str, float]:
        rc = self.run_cfg
        tb, log, bar = self._open_logs()
        last_save, metrics, recent = time.monotonic(), {}, []
        mark, mark_tokens, logged = time.perf_counter(), self.tokens_seen, self.elapsed_s
        try:
            while not self.done:
                i = self.batch_index(self.step)
                pending = self.train_step(self.batches[i])
                self.step += 1
                self.tokens_seen += self.batch_tokens[i]
                if bar is not None:
                    bar.update(1)
                if not self.world.parallel:
                    # host time since the last read (provisional), so the time budget and the schedule advance
                    self.elapsed_s = logged + time.perf_counter() - mark
                if self.step % rc.log_every and not self.done:
                    continue
                metrics = {k: float(v) for k, v in pending.items()}  # the one host sync of the interval
                now = time.perf_counter()
                dt = agree(self.world, counted_seconds(now - mark, recent, self.tokens_seen - mark_tokens), self.device)
                metrics.update(
                    tokens_per_s=(self.tokens_seen - mark_tokens) / max(dt, 1e-9), tokens_seen=self.tokens_seen
                )
                self.elapsed_s = logged + dt
                mark, mark_tokens, logged = now, self.tokens_seen, self.elapsed_s
                if log is not None:
                    self._log(tb, log, bar, metrics)
                due = rc.save_every_steps and self.step % rc.save_every_steps == 0
                if (due or time.monotonic() - last_save >= rc.save_every_s) and not self.done:
                    self.save()
                    last_save = time.monotonic()
            self.save()
        finally:
            for f in (bar, tb, log):
                if f is not None:
                    f.close()
        return metrics

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def _open_logs(self):
        """(TensorBoard writer, metrics.jsonl, tqdm bar) on rank 0, Nones elsewhere. A resumed run keeps
        the rows up to its step (a stopped run may have logged past its last checkpoint)."""
        if not self.world.main:
            return None, None, None
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "metrics.jsonl"
        rows = path.read_text().splitlines() if self.step and path.is_file() else []
        path.write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= self.step))
        bar = tqdm(
            total=self.run_cfg.total_steps,
            initial=self.step,
            disable=not self.run_cfg.progress_bar,
            dynamic_ncols=True,
            mininterval=5,
        )
        return SummaryWriter(str(self.out / "tb")), open(path, "a"), bar

    def _log(self, tb, log, bar, m: dict[str, float]) -> None:
        for k, v in m.items():
            tb.add_scalar(f"train/{k}", v, self.step)
        log.write(
            json.dumps({"step": self.step, "time": round(self.elapsed_s, 1), **{k: round(v, 5) for k, v in m.items()}})
            + "\n"
        )
        log.flush()
        first = "" if len(self.tasks) == 1 else f"{self.tasks[0].name}/"
        bar.set_postfix(
            loss=f"{m[first + 'loss']:.3f}",
            acc0=f"{m.get(first + 'acc_0', 0):.3f}",
            tok_s=f"{m['tokens_per_s']:.0f}",
            refresh=False,
        )
