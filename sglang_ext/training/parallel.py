"""Data parallel training over torch.distributed: what `torchrun` starts, one process per device.

    torchrun --standalone --nproc-per-node 2 -m moa_serve.entrypoints.cli train job ...      (one machine)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m moa_serve.entrypoints.cli train ...

Every rank loads the frozen target and the heads, forms the same global batches (so a run's data and
schedule do not depend on the number of ranks) and trains on its rows of each (data.Part); the heads'
gradients are summed over the ranks by DistributedDataParallel (gloo on CPUs, NCCL on GPUs). A loss
divides by the counts of the whole global batch (Batch.total), so the summed gradient is the
gradient of the global batch's loss: N ranks train as one rank on the same global batch would.
Only rank 0 logs, evaluates and writes files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class World:
    """This process's place among the ranks (torchrun's RANK / WORLD_SIZE / LOCAL_RANK)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def device(self, device: str) -> str:
        """The device of this rank: cuda -> cuda:<local rank> when there are several ranks."""
        return f"cuda:{self.local_rank}" if self.parallel and device == "cuda" else device


def from_env(env: dict[str, str] | None = None) -> World:
    """The world torchrun describes in the environment (a plain process: rank 0 of 1)."""
    env = os.environ if env is None else env
    try:
        world = World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({e})") from None
    if not 0 <= world.rank < world.size:
        raise ValueError(f"RANK {world.rank} outside WORLD_SIZE {world.size}")
    return world


def start(world: World, device: torch.device, init_method: str | None = None) -> None:
    """Join the process group (gloo for CPU tensors, NCCL for CUDA ones); nothing for one rank.
    init_method defaults to torchrun's env:// rendezvous."""
    import torch.distributed as dist

    if not world.parallel or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method or "env://", rank=world.rank, world_size=world.size)


def settle(world: World) -> None:
    """A barrier of every rank after a job's last step, before stop(): a rank that tears the group down while
    another still uses it aborted the other at exit (gloo: "terminate called without an active exception")."""
    import torch.distributed as dist

    if world.parallel and dist.is_initialized():
        dist.barrier()


def stop() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def agree(world: World, value: float, device: torch.device) -> float:
    """Rank 0's value on every rank (wall-clock readings the schedule or the stop depend on)."""
    if not world.parallel:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return float(t)


def all_agree(world: World, flags: list[bool], device: torch.device) -> list[bool]:
    """Whether each flag holds on every rank."""
    if not world.parallel:
        return flags
    import torch.distributed as dist

    t = torch.tensor([int(not f) for f in flags], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return [int(x) == 0 for x in t.tolist()]


class _TaskLoss(torch.nn.Module):
    """A task's loss as a module forward (what DistributedDataParallel wraps); its parameters are the head's."""

    def __init__(self, task):
        super().__init__()
        self.head = task.module
        self._task = task

    def forward(self, batch, tout, progress: float):
        return self._task.loss(batch, tout, progress)


def _sum_hook(state, bucket):
    """Gradients summed over the ranks (DDP's default divides by the world size; each rank's loss is
    already its share of the global batch's)."""
    import torch.distributed as dist

    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def data_parallel_loss(task):
    """task.loss through DistributedDataParallel: the backward of its loss sums the head's gradients
    over the ranks. The ranks' heads start from rank 0's weights."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_TaskLoss(task), forward_sync_buffers=False)  # (the draft vocab: the same everywhere)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp
