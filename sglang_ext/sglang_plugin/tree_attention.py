"""One interface, four tree-attention backends for the MoA draft passes:
fn(q [T, Hq, D], k_pool [S, Hkv, D], v_pool, plan: AttentionPlan, scale) -> [T, Hq, D].

    flashinfer  BatchPrefillWithPagedKVCacheWrapper, page_size 1, custom mask (attention/flashinfer_plan.py);
                a FlashInferTreeAttention per call of select_tree_attention, planned once per step
    triton      our tree kernel over the plan's ragged view (attention/triton_tree.py)
    cpu         our AVX2 kernel for few queries per request, else torch (attention/cpu.py)
    torch       SDPA over the plan's padded view (attention/torch_ref.py), the reference

Choice: $MOA_SGLANG_DRAFT_ATTENTION (auto | flashinfer | triton | cpu | torch); auto = flashinfer
when importable on CUDA, else triton on CUDA, else cpu. The target's verify pass is SGLang's own
backend (--attention-backend); only the draft passes use these.
"""

from __future__ import annotations

import importlib.util

import torch

from ..attention import AttentionFn, select_backend
from .options import BACKENDS, DRAFT_ATTENTION_ENV, draft_attention


def resolve_backend_name(device: torch.device | str, name: str | None = None) -> str:
    name = name or draft_attention()
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return "cpu"  # our AVX2 kernel where it applies, else the torch reference
        return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"
    if name not in BACKENDS:
        raise ValueError(f"{DRAFT_ATTENTION_ENV}={name!r}: choose auto, {', '.join(BACKENDS)}")
    return name


def select_tree_attention(device: torch.device | str, name: str | None = None) -> AttentionFn:
    name = resolve_backend_name(device, name)
    if name == "flashinfer":
        from ..attention.flashinfer_plan import FlashInferTreeAttention

        return FlashInferTreeAttention()  # the caller holds it: its workspace and the step it planned
    return select_backend(device, name)  # cpu, torch, triton
