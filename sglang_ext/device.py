"""Host -> device copies of a step's inputs that start on the host (slot ids, token ids, lengths).

Rule: a step's device work reads nothing back from the device; what the host knows (request lengths,
token ids, slot ids) it uploads. A copy from ordinary (pageable) host memory makes the host wait for
the device's queue to drain; from pinned memory it is queued like a kernel (non_blocking), so the
host never waits. Pinning needs a CUDA runtime: without one (a CPU-only host; fake tensors in tests)
the copy is a plain .to().
"""

from __future__ import annotations

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether a and b name the same device ('cuda' and 'cuda:0' do)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """x on `device`: itself if there, else copied (pinned and queued, from the host to a GPU)."""
    device = torch.device(device)
    if same_device(x.device, device):
        return x
    if x.device.type == "cpu" and device.type != "cpu":
        # (without a CUDA runtime, e.g. fake tensors on a CPU-only host, there is no pinning; the copy is
        # still asked as queued, so a test that flags blocking uploads sees what a GPU host does)
        return (x.pin_memory() if device.type == "cuda" and torch.cuda.is_available() else x).to(
            device, non_blocking=True
        )
    return x.to(device)


def upload(tensors: list[torch.Tensor | None], device: torch.device | str) -> list[torch.Tensor | None]:
    """The tensors on `device`: those elsewhere packed into one buffer per dtype and copied once (None
    stays None). A few ops per dtype plus one view per tensor of more than one dimension (the flat
    buffer's split gives the 1-D ones as they are)."""
    device = torch.device(device)
    out = list(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None and not same_device(t.device, device):
            by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = to_device(torch.cat([_flat(tensors[i]) for i in idx]), device)
        parts = flat.split([tensors[i].numel() for i in idx])
        for i, part in zip(idx, parts):
            out[i] = part if tensors[i].dim() == 1 else part.view(tensors[i].shape)
    return out


def grow(olds: list[torch.Tensor], adds: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each 1-D olds[i] with adds[i] appended, the batch's lists in one cat: each result a view of it (so a list is
    never written in place: a view another holder keeps stays as it was). Two ops for the batch, not one per list."""
    if not olds:
        return []
    grown = torch.cat([x for o, a in zip(olds, adds) for x in (o, a)])
    return list(grown.split([o.numel() + a.numel() for o, a in zip(olds, adds)]))


def rejoin(pieces: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(pieces) (dim 0), without an op when the pieces are one tensor's consecutive row blocks in order,
    covering it whole (what its split gave: e.g. a batch's rows gathered in one op, split per request)."""
    base = pieces[0]._base if len(pieces) > 1 else None
    if base is None or not base.is_contiguous() or base.dim() != pieces[0].dim():
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    at, row = base.storage_offset(), base.stride(0) if base.dim() else 1
    for p in pieces:
        if p._base is not base or p.storage_offset() != at or p.shape[1:] != base.shape[1:] or not p.is_contiguous():
            return torch.cat(pieces)
        at += p.shape[0] * row
    return base if at == base.storage_offset() + base.shape[0] * row else torch.cat(pieces)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as 1-D (itself when it is; a view otherwise, a copy when it is not contiguous)."""
    return t if t.dim() == 1 else t.reshape(-1)


def module_on(module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """The module with its weights and buffers on `device` in `dtype`, and its plain tensor attributes
    (kept out of the buffers so that .to(dtype) leaves them alone, e.g. RoPE frequencies in fp32) on
    `device` in their own dtype: a drafter beside its target, nothing left on the host."""
    module = module.to(device=device, dtype=dtype)
    for m in module.modules():
        plain = {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}
        for name, value in plain.items():
            setattr(m, name, to_device(value, device))
    return module


class HostCopy:
    """A device tensor's values on their way to the host: a copy queued behind the work that produces them
    (into `buf`, host memory; `event` marks the copy done on the device). wait() blocks until it is, then
    gives the values as Python numbers."""

    def __init__(self, buf: torch.Tensor, event=None):
        self.buf, self.event = buf, event

    def wait(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.buf.tolist()


class Stream:
    """How the host issues a step's device work and reads its results back (the host's view of a device's
    queue). This one is a CPU's: work has run when the call that issued it returns.

    `asynchronous`: issued work returns before it runs (CUDA; a test's stand-in on the CPU), so the host can
    prepare the next step while the device runs this one, and reads a result through `to_host`;
    `graphs`: `capture` records a function once and its graph replays it (models/graph_runner.GraphCache).
    `copies` counts the device-to-host copies issued through `to_host`."""

    asynchronous = False
    graphs = False

    def __init__(self):
        self.copies = 0

    def launch(self, fn, *args) -> None:
        """Device work the host issues outside a graph (a buffer fill, a table write), in order with the rest."""
        fn(*args)

    def capture(self, fn, bufs: dict, pool):
        """-> (graph, its outputs, the memory pool for the next capture): fn(bufs) recorded as a graph."""
        raise NotImplementedError(f"{type(self).__name__} does not capture graphs")

    def to_host(self, t: torch.Tensor) -> HostCopy:
        """t's values copied to the host behind the work issued so far (read them with wait())."""
        self.copies += 1
        return HostCopy(t)

    def synchronize(self) -> None:
        """Wait until every issued work has run."""


class CudaStream(Stream):
    """The current CUDA stream: kernels, graph replays and copies from pinned memory are queued on it by
    nature; `to_host` queues a copy into pinned memory and an event behind it, so the host waits for that
    step alone, not for the steps issued after it."""

    asynchronous = True
    graphs = True

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)

    def to_host(self, t: torch.Tensor) -> HostCopy:
        self.copies += 1
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return HostCopy(buf, event)

    def capture(self, fn, bufs: dict, pool):
        # warmup on a side stream (lazy inits, allocator caches, Triton/cuBLAS autotuning stay out of the graph)
        device = self.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(bufs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(bufs)
        return graph, out, graph.pool()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def default_stream(device: torch.device | str) -> Stream:
    """The stream a device's work goes on: CUDA's current stream, else a synchronous one."""
    device = torch.device(device)
    return CudaStream(device) if device.type == "cuda" else Stream()
