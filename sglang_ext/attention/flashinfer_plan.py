"""FlashInfer tree-attention planning (pure host code) and the FlashInfer kernel call.

One tree-attention step of a batch, in the ragged layout all three backends share
(torch reference, Triton, FlashInfer):

    request b:   Q_b queries (its tree nodes of this step), K_b kv slots (prefix + tree slots)
    qo_indptr    [B+1]  cumsum Q_b                      rows of b in the flat q/out tensor
    kv_indptr    [B+1]  cumsum K_b                      (page_size = 1: one slot = one page)
    kv_indices   [sum K_b]                              slots in the KV pool
    kv_last_page_len [B] = 1                            every page holds one token
    custom_mask  [sum Q_b*K_b] bool                     row-major Q_b x K_b per request

FlashInfer's kernel reads the mask bit-packed, one segment per request padded to whole bytes,
little-endian bit order inside a byte (element i of a segment is bit i % 8 of byte i // 8; this
is `numpy.packbits(..., bitorder="little")` per segment, and what SGLang's own
`pack_verify_mask_into` writes for the verify CUDA graph):

    mask_indptr  [B+1]  cumsum ceil(Q_b*K_b / 8)        byte offset of request b's segment
    packed_mask  [mask_indptr[-1]] uint8

Everything here except `FlashInferTreeAttention`'s kernel calls runs on any device; those need
`flashinfer` and a CUDA device and have not been executed on this CPU-only machine. No state lives
in this module: a FlashInferTreeAttention instance holds its workspace and planned step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import AttentionPlan, PaddedGroup

_BIT = torch.arange(8, dtype=torch.uint8)


@dataclass
class FlashInferPlan:
    """Arguments of BatchPrefillWithPagedKVCacheWrapper.plan for a page_size = 1 pool."""

    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [sum K_b] int32
    kv_last_page_len: torch.Tensor  # [B] int32, all ones
    custom_mask: torch.Tensor | None  # [sum Q_b*K_b] bool; None = every query sees its whole kv
    packed_mask: torch.Tensor | None  # [mask_indptr[-1]] uint8
    mask_indptr: torch.Tensor | None  # [B+1] int32, bytes


# --- bit packing --------------------------------------------------------------------------------


def packbits_little(bits: torch.Tensor) -> torch.Tensor:
    """1-D bool -> uint8, element i is bit i % 8 of byte i // 8 (zero padded to whole bytes)."""
    bits = bits.reshape(-1).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) << _BIT.to(bits.device)).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpackbits_little(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of packbits_little: the first `count` bits as bool."""
    bits = (packed.reshape(-1, 1) >> _BIT.to(packed.device)) & 1
    return bits.reshape(-1)[:count].bool()


def segment_packbits_little(bits: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each segment bits[indptr[i]:indptr[i+1]] on its own -> (packed uint8, byte indptr)."""
    bounds = indptr.tolist()
    segments = [packbits_little(bits[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    sizes = torch.tensor([0] + [s.numel() for s in segments])
    packed = torch.cat(segments) if segments else torch.empty(0, dtype=torch.uint8)
    return packed, sizes.cumsum(0).to(torch.int32)


def segment_unpackbits_little(packed: torch.Tensor, mask_indptr: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per-request bool segments (counts[b] = Q_b*K_b) from a segment-packed mask, concatenated."""
    starts = mask_indptr.tolist()
    return torch.cat([unpackbits_little(packed[starts[b] : starts[b + 1]], n) for b, n in enumerate(counts)])


# --- planning -----------------------------------------------------------------------------------


def flashinfer_plan(plan: AttentionPlan, with_mask: bool | None = None) -> FlashInferPlan:
    """The FlashInfer view of an AttentionPlan. with_mask=None: pack the mask only if any bit is off."""
    q_lens = plan.qo_indptr.diff()
    k_lens = plan.kv_indptr.diff()
    if with_mask is None:
        with_mask = not bool(plan.custom_mask.all())
    packed = mask_indptr = mask = None
    if with_mask:
        bit_indptr = torch.cat([torch.zeros(1, dtype=torch.long), (q_lens * k_lens).cumsum(0)])
        mask = plan.custom_mask.bool()
        packed, mask_indptr = segment_packbits_little(mask, bit_indptr)
    return FlashInferPlan(
        qo_indptr=plan.qo_indptr.to(torch.int32),
        kv_indptr=plan.kv_indptr.to(torch.int32),
        kv_indices=plan.kv_indices.to(torch.int32),
        kv_last_page_len=torch.ones(plan.batch_size, dtype=torch.int32),
        custom_mask=mask,
        packed_mask=packed,
        mask_indptr=mask_indptr,
    )


def plan_from_ragged(
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, custom_mask: torch.Tensor | None = None
) -> AttentionPlan:
    """An AttentionPlan (ragged + padded views) from ragged arrays; custom_mask None = all visible.

    Vectorised (no per-request Python loop) so the MoA worker can plan on the GPU every step.
    """
    dev = kv_indices.device
    qo_indptr, kv_indptr = qo_indptr.long().to(dev), kv_indptr.long().to(dev)
    q_lens, k_lens = qo_indptr.diff(), kv_indptr.diff()
    bsz = q_lens.numel()
    if custom_mask is None:
        custom_mask = torch.ones(int((q_lens * k_lens).sum()), dtype=torch.bool, device=dev)
    q_max, k_max = int(q_lens.max()), int(k_lens.max())
    ar_q, ar_k = torch.arange(q_max, device=dev), torch.arange(k_max, device=dev)
    q_valid = ar_q[None, :] < q_lens[:, None]
    k_valid = ar_k[None, :] < k_lens[:, None]
    q_index = torch.where(q_valid, qo_indptr[:-1, None] + ar_q[None, :], 0)
    kv_slots = torch.where(
        k_valid, kv_indices[(kv_indptr[:-1, None] + ar_k[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))], 0
    )
    mask_start = torch.cat([q_lens.new_zeros(1), (q_lens * k_lens).cumsum(0)])[:-1]
    cell = mask_start[:, None, None] + ar_q[None, :, None] * k_lens[:, None, None] + ar_k[None, None, :]
    valid = q_valid[:, :, None] & k_valid[:, None, :]
    mask = torch.where(valid, custom_mask[cell.clamp(max=max(custom_mask.numel() - 1, 0))], False)
    # NOTE: padded query rows must see something, or softmax over an empty row gives NaN.
    mask[:, :, 0] |= ~q_valid
    if bsz == 1 and bool(custom_mask.all()):
        mask_out = None
    else:
        mask_out = mask[:, None]
    return AttentionPlan(
        qo_indptr.cpu(),
        kv_indptr.cpu(),
        kv_indices.long(),
        custom_mask.bool(),
        [PaddedGroup(q_index, q_valid, kv_slots, mask_out)],
    )


# --- reference consumer of the FlashInfer arguments ------------------------------------------------


def paged_attention_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, fi: FlashInferPlan, scale: float
) -> torch.Tensor:
    """Masked attention that reads exactly what FlashInfer's kernel reads (page_size = 1).

    Per request: its qo rows, its kv pages (kv_last_page_len says how full the last one is), and
    its packed mask segment at mask_indptr. Plain loops: the point is an independent check of the
    planning, not speed.
    """
    out = torch.zeros_like(q, dtype=torch.float32)
    group = q.shape[1] // k_pool.shape[1]
    qo, kv, last = fi.qo_indptr.tolist(), fi.kv_indptr.tolist(), fi.kv_last_page_len.tolist()
    for b in range(len(qo) - 1):
        q_len = qo[b + 1] - qo[b]
        k_len = (kv[b + 1] - kv[b] - 1) * 1 + last[b]  # page_size 1
        slots = fi.kv_indices[kv[b] : kv[b] + k_len].long()
        if fi.packed_mask is not None:
            seg = fi.packed_mask[int(fi.mask_indptr[b]) : int(fi.mask_indptr[b + 1])]
            mask = unpackbits_little(seg, q_len * k_len).view(q_len, k_len)
        else:
            mask = torch.ones(q_len, k_len, dtype=torch.bool)
        qb = q[qo[b] : qo[b + 1]].float()  # [q, H, D]
        kb = k_pool[slots].float().repeat_interleave(group, dim=1)  # [k, H, D]
        vb = v_pool[slots].float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        s = s.masked_fill(~mask.to(s.device)[None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # an all-masked row gives zeros, like FlashInfer
        out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", p, vb)
    return out.to(q.dtype)


# --- the FlashInfer kernel (GPU only) -------------------------------------------------------------

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's scratch buffer for plan() / run()


@dataclass
class FlashInferStep:
    """One step's planned FlashInfer wrapper: plan() ran once on the host, run() serves every layer."""

    plan: AttentionPlan  # the plan it was made for: a step is reused only for this very object
    layout: tuple  # (num_qo_heads, num_kv_heads, head_dim, q dtype, kv dtype, scale)
    wrapper: object  # flashinfer.BatchPrefillWithPagedKVCacheWrapper

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], pools [S, Hkv, D] (pages of one token, NHD) -> [T, Hq, D]."""
        return self.wrapper.run(q.contiguous(), (k_pool.unsqueeze(1), v_pool.unsqueeze(1)))


def _layout(q: torch.Tensor, k_pool: torch.Tensor, scale: float) -> tuple:
    return (q.shape[1], k_pool.shape[1], q.shape[2], q.dtype, k_pool.dtype, scale)


class FlashInferTreeAttention:
    """Tree attention on FlashInfer's paged prefill kernel, same signature and result as
    tree_attention_torch: fn(q [T, Hq, D], k_pool [S, Hkv, D], v_pool, plan, scale) -> [T, Hq, D].

    One instance per caller (the MoA worker holds one): it owns the workspace and the step planned
    last. A step is planned once (plan(), host work) and run per layer (FlashInferStep.run); a call
    with the plan object and layout of the held step only runs, any other call plans first.

    The bool mask goes to plan(custom_mask=...), which packs it into the layout `flashinfer_plan`
    computes (checked on CPU against SGLang's pack kernel); plan() itself is not CUDA-graph safe, so
    graph capture writes `FlashInferPlan.packed_mask`/`mask_indptr` into the wrapper's buffers instead.
    The kernel has not run on this CPU-only machine (tests/sglang_ext/test_sglang_plugin.py::test_flashinfer_*
    is marked gpu); the planning and reuse are checked on CPU against a stand-in wrapper.
    """

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self.workspace_bytes = workspace_bytes
        self.workspace: torch.Tensor | None = None  # on the device of the last step
        self.step: FlashInferStep | None = None

    def plan(self, plan: AttentionPlan, layout: tuple, device: torch.device) -> FlashInferStep:
        """Plan one step: FlashInfer's arguments for `plan`, handed to a wrapper over this instance's workspace."""
        import flashinfer  # noqa: PLC0415 - GPU-only dependency

        num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale = layout
        if self.workspace is None or self.workspace.device != device:
            self.workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        fi = flashinfer_plan(plan)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        wrapper.plan(
            fi.qo_indptr.to(device),
            fi.kv_indptr.to(device),
            fi.kv_indices.to(device),
            fi.kv_last_page_len.to(device),
            num_qo_heads,
            num_kv_heads,
            head_dim,
            1,  # page_size
            custom_mask=None if fi.custom_mask is None else fi.custom_mask.to(device),
            causal=False,
            sm_scale=scale,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )
        return FlashInferStep(plan, layout, wrapper)

    def __call__(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttentionPlan, scale: float
    ) -> torch.Tensor:
        layout = _layout(q, k_pool, scale)
        step = self.step
        if step is None or step.plan is not plan or step.layout != layout:
            step = self.step = self.plan(plan, layout, q.device)
        return step.run(q, k_pool, v_pool)


__all__ = [
    "FlashInferPlan",
    "FlashInferStep",
    "FlashInferTreeAttention",
    "WORKSPACE_BYTES",
    "flashinfer_plan",
    "packbits_little",
    "paged_attention_reference",
    "plan_from_ragged",
    "segment_packbits_little",
    "segment_unpackbits_little",
    "unpackbits_little",
]
