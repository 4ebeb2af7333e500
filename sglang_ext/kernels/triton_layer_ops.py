"""A decoder layer's glue on a GPU as four Triton kernels, the device twins of the CPU layer ops
(cpu_layer_ops.cpp): RMSNorm, residual add + RMSNorm, RoPE + K/V store, SiLU * up.

Why: a small model's step is a few hundred tiny kernels (a decode of SmolLM2 is ~30 per layer: the norm's
pow / mean / rsqrt / mul, RoPE's slices, cat and muls, the K/V index writes, SiLU and its product), each a
few microseconds on the GPU even inside a CUDA graph. With these a layer is ten: the two norms, RoPE with
the K/V store, SiLU * up, the four matmuls, the attention and the last residual add.

    rms_norm(x, w, eps)                    x [T, H] -> [T, H]
    add_rms_norm(x, r, w, eps)             (x + r, rms_norm(x + r)), both [T, H]
    rope_store(qkv, cos, sin, k_pool, v_pool, slots, num_heads, num_kv_heads)
                                           qkv [T, (Hq + 2 Hkv) D], cos / sin [T, D] -> q [T, Hq, D] rotated;
                                           k rotated and v written to the pools at slots [T]
    silu_mul(gu)                           gu [T, 2 I] -> silu(gate) * up [T, I]

Each program owns one row (one token, or one token's head): a row's result never depends on the other
rows of the batch, so decode and verify rows agree bit for bit, eagerly or in a graph. Arithmetic is
fp32, rounded once to the activations' dtype (the torch ops round after each op: the results differ in
the last bf16 bit, identically for every path that uses these). On CPU tensors the kernels run under
TRITON_INTERPRET=1 only (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, R, W, Y, S, stride_x, stride_r, stride_y, stride_s, eps, H, ADD: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD:  # the residual sum, rounded to the activations' dtype as the stream keeps it
        x = x + tl.load(R + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        x = x.to(S.dtype.element_ty)
        tl.store(S + row * stride_s + offs, x, mask=ok)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    n = (x * (1.0 / tl.sqrt(var + eps))).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (n * w).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _rope_store_kernel(
    QKV,
    COS,
    SIN,
    Q,
    K,
    V,
    SLOTS,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)  # q heads, then k heads, then v heads
    offs = tl.arange(0, HALF)
    src = QKV + t * stride_qkv + h * 2 * HALF
    a = tl.load(src + offs).to(tl.float32)
    b = tl.load(src + HALF + offs).to(tl.float32)
    if h < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate the halves (HF's rotate_half convention)
        c1 = tl.load(COS + t * stride_cos + offs).to(tl.float32)
        c2 = tl.load(COS + t * stride_cos + HALF + offs).to(tl.float32)
        s1 = tl.load(SIN + t * stride_sin + offs).to(tl.float32)
        s2 = tl.load(SIN + t * stride_sin + HALF + offs).to(tl.float32)
        first, second = a * c1 - b * s1, b * c2 + a * s2
        if h < NUM_HEADS:
            dst = Q + t * stride_qt + h * stride_qh
        else:
            dst = K + tl.load(SLOTS + t) * stride_kt + (h - NUM_HEADS) * stride_kh
    else:
        first, second = a, b
        dst = V + tl.load(SLOTS + t) * stride_vt + (h - NUM_HEADS - NUM_KV_HEADS) * stride_vh
    tl.store(dst + offs, first.to(dst.dtype.element_ty))
    tl.store(dst + HALF + offs, second.to(dst.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(GU, Y, stride_gu, stride_y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(GU + row * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + I + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected [T, H] rows, got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = _rows(x, "rms_norm")
    y = torch.empty_like(x)
    if x.shape[0]:
        h = x.shape[1]
        _rms_norm_kernel[(x.shape[0],)](
            x, x, w, y, y, x.stride(0), x.stride(0), y.stride(0), y.stride(0), eps, h, False, triton.next_power_of_2(h)
        )
    return y


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x, r = _rows(x, "add_rms_norm"), _rows(r, "add_rms_norm")
    if r.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(r.shape)} != {tuple(x.shape)}")
    s, y = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        h = x.shape[1]
        _rms_norm_kernel[(x.shape[0],)](
            x, r, w, y, s, x.stride(0), r.stride(0), y.stride(0), s.stride(0), eps, h, True, triton.next_power_of_2(h)
        )
    return s, y


def rope_store(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [T] int64, on qkv's device
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # q [T, Hq, D]
    t, width = qkv.shape
    d = k_pool.shape[-1]
    if not k_pool.dtype == v_pool.dtype == qkv.dtype:
        raise ValueError(f"rope_store: pools {k_pool.dtype} / {v_pool.dtype} for {qkv.dtype} activations")
    if width != (num_heads + 2 * num_kv_heads) * d or d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"rope_store: qkv width {width} for {num_heads} + 2 x {num_kv_heads} heads of {d}")
    if tuple(cos.shape) != (t, d) or tuple(sin.shape) != (t, d) or tuple(slots.shape) != (t,):
        raise ValueError(f"rope_store: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, slots {tuple(slots.shape)}")
    qkv, cos, sin = _rows(qkv, "rope_store"), _rows(cos, "rope_store"), _rows(sin, "rope_store")
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_store_kernel[(t, num_heads + 2 * num_kv_heads)](
            qkv,
            cos,
            sin,
            q,
            k_pool,
            v_pool,
            slots.contiguous(),
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            q.stride(0),
            q.stride(1),
            k_pool.stride(0),
            k_pool.stride(1),
            v_pool.stride(0),
            v_pool.stride(1),
            num_heads,
            num_kv_heads,
            d // 2,
        )
    return q


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    gu = _rows(gu, "silu_mul")
    t, width = gu.shape
    inter = width // 2
    y = torch.empty(t, inter, dtype=gu.dtype, device=gu.device)
    if t:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gu, y, gu.stride(0), y.stride(0), inter, block)
    return y
