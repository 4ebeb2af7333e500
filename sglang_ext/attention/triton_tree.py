"""Tree attention as a Triton kernel over the plan's ragged (FlashInfer-style) view, or over the graph
runner's padded one.

Same signature and result as `tree_attention_torch`; reads K/V straight from the pool through
`plan.kv_indices`, so nothing is gathered or padded.

    q rows of b:    qo_indptr[b] .. qo_indptr[b+1]          (Q_b rows)
    kv slots of b:  kv_indices[kv_indptr[b] .. kv_indptr[b+1]]   (K_b slots)
    mask of b:      custom_mask[mask_start_b + i*K_b + j]   (row-major Q_b x K_b, mask_start = cumsum Q*K)

One program per (query row, q head) streams the columns that row may see, in column order, in
BLOCK_N chunks with an online softmax (running max m, denominator l, accumulator acc, all fp32).
Why per row and not a tile of rows through tensor-core dots: lossless greedy decoding needs a verify
tree's row to compute exactly what decoding its token alone computes. That row sees [committed prefix
| its ancestors | itself]; the decode sees [committed prefix + the same tokens, now committed | itself]:
the same K/V in the same order, but in a tree interleaved with siblings it must not see. A tile's dot
sums a block's columns together, masked ones as zeros, in an order fixed by the columns' positions,
so the two would round differently. Streaming only the visible columns (the row's mask compacted:
`row_streams`) from position 0, in the same blocks, makes the two the same arithmetic, bit for bit, and
keeps each row's result independent of the rows beside it (batch, tree, padding).

NOTE: a query row whose mask is all False gets zeros (FlashInfer's convention); the SDPA reference
would give NaN there. Tree masks always let a node see itself, so real plans never hit this.

On CPU this only runs under TRITON_INTERPRET=1, which must be set before `triton` is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .plan import AttentionPlan

BLOCK_N = 64  # visible columns per inner step (one fixed size: a row's blocks never depend on the batch)


@dataclass
class RowStreams:
    """Per query row t (flat): which columns it reads, in order. Built on the device, no host reads.

    cols [sum of segment lengths] int64: segment t holds row t's visible columns (indices into its
      request's columns) first, in column order, then its hidden ones
    seg_start [T] int64: where row t's segment starts in cols
    kv_start [T] int64: where row t's request's columns start in kv_indices
    count [T] int64: how many columns row t sees
    """

    cols: torch.Tensor
    seg_start: torch.Tensor
    kv_start: torch.Tensor
    count: torch.Tensor


def row_streams_padded(allowed: torch.Tensor) -> RowStreams:
    """allowed [B, Q, K] bool (the static plan's): each row's visible columns first, in order."""
    b, q, k = allowed.shape
    cols = torch.arange(k, device=allowed.device)
    order = torch.where(allowed, cols, cols + k).argsort(dim=-1)  # keys unique: no tie to break
    rows = torch.arange(b * q, device=allowed.device)
    kv_start = torch.div(rows, q, rounding_mode="floor") * k
    return RowStreams(order.reshape(-1), rows * k, kv_start, allowed.sum(-1).view(-1))


def row_streams_ragged(plan: AttentionPlan, t: int) -> RowStreams:
    """The same for a ragged plan of t query rows (on its device; the mask's segments are row-major per
    request)."""
    dev = plan.kv_indices.device
    q_lens = plan.qo_indptr.diff()
    k_lens = plan.kv_indptr.diff()
    m = plan.custom_mask.numel()
    req = torch.repeat_interleave(torch.arange(plan.batch_size, device=dev), q_lens, output_size=t)
    mask_indptr = plan.mask_indptr
    if mask_indptr is None:
        sizes = q_lens * k_lens
        mask_indptr = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    row_k = k_lens[req]
    seg_start = mask_indptr[req] + (torch.arange(t, device=dev) - plan.qo_indptr[req]) * row_k
    row_of = torch.repeat_interleave(torch.arange(t, device=dev), row_k, output_size=m)  # [M]
    col = torch.arange(m, device=dev) - seg_start[row_of]
    width = m + 1  # more than any row's column count
    visible = plan.custom_mask.bool()
    order = (row_of * (2 * width) + torch.where(visible, col, col + width)).argsort()  # segments stay in place
    count = torch.zeros(t, dtype=torch.long, device=dev).index_add_(0, row_of, visible.long())
    return RowStreams(col[order], seg_start, plan.kv_indptr[req], count)


@triton.jit
def _row_attention_kernel(
    Q,
    K,
    V,
    O,  # q/o [T, Hq, D]; k/v pools [S, Hkv, D]
    kv_indices,
    cols,
    seg_start,
    kv_start,
    count,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    scale,
    GROUP: tl.constexpr,  # q heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seg = tl.load(seg_start + t)
    base = tl.load(kv_start + t)
    n = tl.load(count + t)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + t * stride_qt + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)

    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)  # fp32 scalars carried by the loop
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        col = tl.load(cols + seg + offs_n, mask=n_ok, other=0)
        slots = tl.load(kv_indices + base + col, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1) * scale
        s = tl.where(n_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def tree_attention_triton(
    q: torch.Tensor,  # [T, Hq, D] flat queries
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    q, k_pool, v_pool = (_last_dim_contiguous(x) for x in (q, k_pool, v_pool))
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out

    plan = plan.on(q.device)  # a plan built elsewhere moves once (cached for the other layers)
    streams = plan.derived("triton_row_streams", lambda: row_streams_ragged(plan, num_tokens))  # once per plan
    _launch(q, k_pool, v_pool, out, plan.kv_indices, streams, scale)
    return out


def tree_attention_static(
    q: torch.Tensor,  # [B*Q, Hq, D] request-major: rows b*Q .. b*Q+Q-1 are request b's (padding included)
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [B, K] int64: request b's columns (its first kv_len[b] are read, the rest is padding)
    allowed: torch.Tensor,  # [B, Q, K] bool: row j of request b reads column c
    kv_len: torch.Tensor,  # [B] int64
    scale: float,
    streams: RowStreams | None = None,  # row_streams_padded(allowed), when the caller keeps it per forward
) -> torch.Tensor:  # [B*Q, Hq, D]
    """The same kernel over a padded batch of fixed shape whose lengths live on the device (a CUDA
    graph's static buffers). A real row whose columns are in the ragged plan's order ([committed
    prefix | its own rows], padding after them) streams the same blocks in the same order as there,
    so it gets the ragged call's result bit for bit: a graph replay equals the eager forward."""
    b, q_per, kv_per = allowed.shape
    num_q_heads, num_kv_heads = q.shape[1], k_pool.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if q.shape[0] != b * q_per or tuple(slots.shape) != (b, kv_per) or tuple(kv_len.shape) != (b,):
        raise ValueError(f"static batch: q {tuple(q.shape)}, slots {tuple(slots.shape)}, allowed {(b, q_per, kv_per)}")
    q, k_pool, v_pool = (_last_dim_contiguous(x) for x in (q, k_pool, v_pool))
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    streams = streams if streams is not None else row_streams_padded(allowed)
    _launch(q, k_pool, v_pool, out, slots.contiguous().view(-1), streams, scale)
    return out


def _launch(q, k_pool, v_pool, out, kv_indices: torch.Tensor, streams: RowStreams, scale: float) -> None:
    head_dim = q.shape[2]
    _row_attention_kernel[(q.shape[0], q.shape[1])](
        q,
        k_pool,
        v_pool,
        out,
        kv_indices,
        streams.cols,
        streams.seg_start,
        streams.kv_start,
        streams.count,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        scale,
        GROUP=q.shape[1] // k_pool.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
    )
