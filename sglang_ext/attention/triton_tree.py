"""Tree attention as a Triton kernel over the plan's ragged (FlashInfer-style) view.

Same signature and result as `tree_attention_torch`; reads K/V straight from the pool through
`plan.kv_indices`, so nothing is gathered or padded.

    grid = (request b, q head h, block of BLOCK_M queries of b)

    q rows of b:    qo_indptr[b] .. qo_indptr[b+1]          (Q_b rows)
    kv slots of b:  kv_indices[kv_indptr[b] .. kv_indptr[b+1]]   (K_b slots)
    mask of b:      custom_mask[mask_start_b + i*K_b + j]   (row-major Q_b x K_b, mask_start = cumsum Q*K)

Each program streams the request's kv in BLOCK_N chunks with an online softmax (FlashAttention-2):
running row max m, running denominator l, unnormalised accumulator acc, all fp32.

NOTE: a query row whose mask is all False gets zeros (FlashInfer's convention); the SDPA reference
would give NaN there. Tree masks always let a node see itself, so real plans never hit this.

On CPU this only runs under TRITON_INTERPRET=1, which must be set before `triton` is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import AttentionPlan

BLOCK_M = 16  # queries per program (tl.dot needs >= 16)
BLOCK_N = 32  # kv positions per inner step


@triton.jit
def _tree_attention_kernel(
    Q,
    K,
    V,
    O,  # q/o [T, Hq, D]; k/v pools [S, Hkv, D]
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    mask_indptr,
    kv_lens,  # PADDED: [B] columns each request reads (the rest of its kv_per columns are padding)
    q_per,  # PADDED: rows per request
    kv_per,  # PADDED: columns per request (kv_indices [B, kv_per], custom_mask [B, q_per, kv_per])
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in fp32 (the interpreter cannot do bf16 arithmetic)
    IEEE_DOT: tl.constexpr,  # fp32 operands: exact dots instead of tf32
    PADDED: tl.constexpr,  # the static layout (fixed shapes, lengths on the device) instead of the ragged one
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    if PADDED:
        q_start = b * q_per
        q_len = q_per
        kv_start = b * kv_per
        kv_len = tl.load(kv_lens + b)
        mask_start = b * q_per * kv_per
        mask_stride = kv_per
    else:
        q_start = tl.load(qo_indptr + b)
        q_len = tl.load(qo_indptr + b + 1) - q_start
        kv_start = tl.load(kv_indptr + b)
        kv_len = tl.load(kv_indptr + b + 1) - kv_start
        mask_start = tl.load(mask_indptr + b)
        mask_stride = kv_len
    kv_head = h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # programs past the request's last query block skip the kv loop entirely
    kv_hi = tl.where(m_block * BLOCK_M < q_len, kv_len, 0)
    for n_start in range(0, kv_hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        allowed = tl.load(
            custom_mask + mask_start + offs_m[:, None] * mask_stride + offs_n[None, :],
            mask=m_ok[:, None] & n_ok[None, :],
            other=0,
        )
        s = tl.where(allowed != 0, s * scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


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

    device = q.device
    plan = plan.on(device)  # a plan built elsewhere moves once (cached for the other layers)
    mask_indptr = plan.mask_indptr
    if mask_indptr is None:  # a plan made without it (plan_from_ragged): derived on the device
        sizes = plan.qo_indptr.diff() * plan.kv_indptr.diff()
        mask_indptr = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])

    grid = (plan.batch_size, num_q_heads, triton.cdiv(plan.max_q_len, BLOCK_M))  # max_q_len: host ints
    ragged = (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.custom_mask, mask_indptr, plan.kv_indptr, 0, 0)
    _launch(grid, q, k_pool, v_pool, out, ragged, scale, padded=False)
    return out


def tree_attention_static(
    q: torch.Tensor,  # [B*Q, Hq, D] request-major: rows b*Q .. b*Q+Q-1 are request b's (padding included)
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [B, K] int64: request b's columns (its first kv_len[b] are read, the rest is padding)
    allowed: torch.Tensor,  # [B, Q, K] bool: row j of request b reads column c
    kv_len: torch.Tensor,  # [B] int64
    scale: float,
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
    grid = (b, num_q_heads, triton.cdiv(q_per, BLOCK_M))
    flat = slots.contiguous().view(-1)
    padded = (flat, flat, flat, allowed.contiguous().view(-1), flat, kv_len, q_per, kv_per)
    _launch(grid, q, k_pool, v_pool, out, padded, scale, padded=True)
    return out


def _launch(grid, q, k_pool, v_pool, out, layout: tuple, scale: float, padded: bool) -> None:
    """layout: (qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, kv_lens, q_per, kv_per)."""
    # NOTE: CPU tensors only run under TRITON_INTERPRET=1, whose tl.dot multiplies bf16 bit patterns
    # (numpy has no bf16; triton-lang/triton#11584), so there the kernel computes in fp32.
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16
    head_dim = q.shape[2]
    _tree_attention_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        *layout,
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
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        UPCAST=upcast,
        IEEE_DOT=upcast or q.dtype == torch.float32,
        PADDED=padded,
    )
