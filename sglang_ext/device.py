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
