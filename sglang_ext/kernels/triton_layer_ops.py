"""A decoder layer on a GPU in five Triton kernels (the attention's included), and the four glue kernels it
fuses, the device twins of the CPU layer ops (cpu_layer_ops.cpp).

Why: a small model's step is a few hundred tiny kernels (a decode of SmolLM2 is ~30 per layer: the norm's
pow / mean / rsqrt / mul, RoPE's slices, cat and muls, the K/V index writes, SiLU and its product), each a
few microseconds on the GPU even inside a CUDA graph (~1.3 us). The glue kernels make a layer ten (the two
norms, RoPE with the K/V store, SiLU * up, the four matmuls, the attention and the last residual add); the
fused matmuls make it five, each norm, epilogue and residual inside the matmul that reads or writes it:

    norm_qkv_rope_store(x, norm_w, eps, qkv_w, qkv_bias, cos, sin, k_pool, v_pool, slots, Hq, Hkv)
                                           x [T, H] -> q [T, Hq, D]: rms_norm, the qkv matmul (+ bias),
                                           RoPE; k and v written to the pools at slots [T]
    (the attention: attention/triton_tree.py)
    linear_residual(a, o_w, x)             x + a @ o_w.T
    norm_gate_up_silu(x, norm_w, eps, gu_w)   silu(gate) * up of rms_norm(x) @ gu_w.T   [T, I]
    linear_residual(h, down_w, x)          x + h @ down_w.T

and the glue kernels (the final norm, and the unfused reference path LlamaModel._layer_forward_unfused):

    rms_norm(x, w, eps)                    x [T, H] -> [T, H]
    add_rms_norm(x, r, w, eps)             (x + r, rms_norm(x + r)), both [T, H]
    rope_store(qkv, cos, sin, k_pool, v_pool, slots, num_heads, num_kv_heads)
                                           qkv [T, (Hq + 2 Hkv) D], cos / sin [T, D] -> q [T, Hq, D] rotated;
                                           k rotated and v written to the pools at slots [T]
    silu_mul(gu)                           gu [T, 2 I] -> silu(gate) * up [T, I]

A row's result never depends on the other rows of the batch: a glue program owns one row (one token, or
one token's head); a fused matmul's tile of BLOCK_M rows sums each row alone over the same BLOCK_K steps
whatever the row count, so decode and verify rows agree bit for bit, eagerly or in a graph. Arithmetic is
fp32; each value an unfused path keeps in the activations' dtype (a matmul's output, the normalised row)
is rounded to it there too (the torch ops round after each op as well: the results differ in the last
bf16 bit, identically for every path that uses these). On CPU tensors the kernels run under
TRITON_INTERPRET=1 only (the tests).
"""

from __future__ import annotations

import os

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


# --- fused matmuls: a layer in five kernels ------------------------------------------------------------------
# EPI: what a fused matmul does with its output tile (a constexpr; the kernel spells the values out)
PLAIN, RESIDUAL, SILU_MUL, ROPE_STORE = 0, 1, 2, 3
BLOCK_M, BLOCK_K = 16, 64  # fixed (never chosen by the row count): a row's sums are the same at any batch


@triton.jit
def _fused_linear_kernel(
    X,  # [T, K] activations
    W,  # [N_w, K] weight rows
    BIAS,  # [N_w] or unused
    NW,  # [K] RMSNorm weight (NORM) or unused
    R,  # [T, N] residual (RESIDUAL) or unused
    Y,  # [T, N] output; ROPE_STORE: q [T, Hq, D]
    COS,  # [T, D] (ROPE_STORE)
    SIN,
    KP,  # [S, Hkv, D] K pool (ROPE_STORE)
    VP,
    SLOTS,  # [T] int64 (ROPE_STORE)
    T,
    N,
    K,
    eps,
    stride_x,
    stride_w,
    stride_r,
    stride_y,
    stride_yh,
    stride_cos,
    stride_sin,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPI: tl.constexpr,  # 0 plain, 1 + residual, 2 silu(gate) * up, 3 RoPE + K/V store
    PAIR: tl.constexpr,  # EPI 2 or 3: two column sets per tile
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    offs = tl.arange(0, BLOCK_N)
    # the output tile's columns: one set, or two for an epilogue that pairs them (gate with up; a head's
    # first half with its second half for RoPE)
    if EPI == 3:
        cols_a = pid_n * 2 * BLOCK_N + offs  # head pid_n (q heads, then k, then v): D = 2 * BLOCK_N
        cols_b = cols_a + BLOCK_N
    elif EPI == 2:
        cols_a = pid_n * BLOCK_N + offs  # gate columns; up columns N further
        cols_b = cols_a + N
    else:
        cols_a = pid_n * BLOCK_N + offs
        cols_b = cols_a
    col_ok = cols_a < N
    if NORM:  # the row's RMS first (a row is read twice: cheap next to the weight tile)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(
                X + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0
            )
            xk = xk.to(tl.float32)
            ss += tl.sum(xk * xk, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:  # rounded as rms_norm's kernel rounds: the normalised row, then times the weight
            n = (a.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            a = (n * tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(X.dtype.element_ty)
        wa = tl.load(W + cols_a[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:  # fp32 operands (see _ieee): exact fp32 products, no TF32
            a = a.to(tl.float32)
            acc_a += tl.dot(a, wa.to(tl.float32), input_precision="ieee")
        else:
            acc_a += tl.dot(a, wa)
        if PAIR:
            wb = tl.load(W + cols_b[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc_b += tl.dot(a, wb.to(tl.float32), input_precision="ieee")
            else:
                acc_b += tl.dot(a, wb)
    if HAS_BIAS:
        acc_a += tl.load(BIAS + cols_a, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if PAIR:
            acc_b += tl.load(BIAS + cols_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # the matmul's result rounded to the activations' dtype, as an unfused matmul's output is
    out_a = acc_a.to(Y.dtype.element_ty).to(tl.float32)
    ok = row_ok[:, None] & col_ok[None, :]
    if EPI == 1:
        r = tl.load(R + rows[:, None] * stride_r + cols_a[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + rows[:, None] * stride_y + cols_a[None, :], (r + out_a).to(Y.dtype.element_ty), mask=ok)
    elif EPI == 2:
        u = acc_b.to(Y.dtype.element_ty).to(tl.float32)
        y = out_a / (1.0 + tl.exp(-out_a)) * u
        tl.store(Y + rows[:, None] * stride_y + cols_a[None, :], y.to(Y.dtype.element_ty), mask=ok)
    elif EPI == 3:
        out_b = acc_b.to(Y.dtype.element_ty).to(tl.float32)
        h = pid_n
        ok = row_ok[:, None] & (offs < BLOCK_N)[None, :]
        if h < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate the halves (HF's rotate_half convention)
            c1 = tl.load(COS + rows[:, None] * stride_cos + offs[None, :], mask=ok, other=0.0).to(tl.float32)
            c2 = tl.load(COS + rows[:, None] * stride_cos + BLOCK_N + offs[None, :], mask=ok, other=0.0)
            s1 = tl.load(SIN + rows[:, None] * stride_sin + offs[None, :], mask=ok, other=0.0).to(tl.float32)
            s2 = tl.load(SIN + rows[:, None] * stride_sin + BLOCK_N + offs[None, :], mask=ok, other=0.0)
            first = out_a * c1 - out_b * s1
            second = out_b * c2.to(tl.float32) + out_a * s2.to(tl.float32)
            if h < NUM_HEADS:
                dst = Y + rows[:, None] * stride_y + h * stride_yh + offs[None, :]
            else:
                slot = tl.load(SLOTS + rows, mask=row_ok, other=0)
                dst = KP + slot[:, None] * stride_kt + (h - NUM_HEADS) * stride_kh + offs[None, :]
        else:
            first, second = out_a, out_b
            slot = tl.load(SLOTS + rows, mask=row_ok, other=0)
            dst = VP + slot[:, None] * stride_vt + (h - NUM_HEADS - NUM_KV_HEADS) * stride_vh + offs[None, :]
        tl.store(dst, first.to(dst.dtype.element_ty), mask=ok)
        tl.store(dst + BLOCK_N, second.to(dst.dtype.element_ty), mask=ok)
    else:
        tl.store(Y + rows[:, None] * stride_y + cols_a[None, :], out_a.to(Y.dtype.element_ty), mask=ok)


def _ieee(dtype: torch.dtype) -> bool:
    """Whether a fused matmul multiplies in fp32 (exact products, fp32 sums): fp32 activations (no TF32, as
    F.linear's default), and any dtype under TRITON_INTERPRET=1 (the interpreter has no bf16 dot: it reads
    the bits as integers). A bf16 product is exact in fp32, so only the sums' order differs from a GPU's
    bf16 dot."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _fused_linear(
    x, w, epi, n, y, bias=None, norm_w=None, eps=0.0, residual=None, rope=None, heads=(0, 0), block_n=64
) -> None:
    """Launches _fused_linear_kernel: y <- epilogue(norm?(x) @ w.T + bias) over N = n output columns (rope:
    (cos, sin, k_pool, v_pool, slots), the grid one program per head)."""
    t, k = x.shape
    if w.shape[1] != k or x.dtype != w.dtype:
        raise ValueError(f"fused linear: x {tuple(x.shape)} {x.dtype} against weight {tuple(w.shape)} {w.dtype}")
    if not t:
        return
    cos, sin, kp, vp, slots = rope if rope is not None else (x, x, y, y, x)
    yh = y.stride(1) if epi == ROPE_STORE else 0
    grid = (triton.cdiv(t, BLOCK_M), heads[0] + 2 * heads[1] if epi == ROPE_STORE else triton.cdiv(n, block_n))
    r = residual if residual is not None else x
    _fused_linear_kernel[grid](
        x,
        w,
        bias if bias is not None else w,
        norm_w if norm_w is not None else w,
        r,
        y,
        cos,
        sin,
        kp,
        vp,
        slots,
        t,
        n,
        k,
        eps,
        x.stride(0),
        w.stride(0),
        r.stride(0),
        y.stride(0),
        yh,
        cos.stride(0),
        sin.stride(0),
        kp.stride(0),
        kp.stride(1) if kp.dim() > 2 else 0,
        vp.stride(0),
        vp.stride(1) if vp.dim() > 2 else 0,
        NORM=norm_w is not None,
        HAS_BIAS=bias is not None,
        EPI=epi,
        PAIR=epi in (SILU_MUL, ROPE_STORE),
        NUM_HEADS=heads[0],
        NUM_KV_HEADS=heads[1],
        IEEE=_ieee(x.dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
    )


def norm_qkv_rope_store(
    x: torch.Tensor,  # [T, H] the residual stream
    norm_w: torch.Tensor,  # [H]
    eps: float,
    qkv_w: torch.Tensor,  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None,  # [(Hq + 2 Hkv) D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    k_pool: torch.Tensor,  # [S, Hkv, D]
    v_pool: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [T] int64, on x's device
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # q [T, Hq, D] rotated; k rotated and v written to the pools at slots
    """rope_store(rms_norm(x) @ qkv_w.T + qkv_bias, ...) in one kernel: a program computes one head's
    columns of a block of rows (its two halves side by side), rotates them and stores them."""
    x = _rows(x, "norm_qkv_rope_store")
    t, d = x.shape[0], k_pool.shape[-1]
    if not k_pool.dtype == v_pool.dtype == x.dtype:
        raise ValueError(f"norm_qkv_rope_store: pools {k_pool.dtype} / {v_pool.dtype} for {x.dtype} activations")
    if qkv_w.shape[0] != (num_heads + 2 * num_kv_heads) * d or d % 32 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"norm_qkv_rope_store: qkv rows {qkv_w.shape[0]} for {num_heads} + 2 x {num_kv_heads} of {d}")
    if tuple(cos.shape) != (t, d) or tuple(sin.shape) != (t, d) or tuple(slots.shape) != (t,):
        raise ValueError(
            f"norm_qkv_rope_store: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, slots {tuple(slots.shape)}"
        )
    cos, sin = _rows(cos, "norm_qkv_rope_store"), _rows(sin, "norm_qkv_rope_store")
    q = torch.empty(t, num_heads, d, dtype=x.dtype, device=x.device)
    rope = (cos, sin, k_pool, v_pool, slots.contiguous())
    _fused_linear(
        x, qkv_w, ROPE_STORE, qkv_w.shape[0], q, qkv_bias, norm_w, eps, rope=rope,
        heads=(num_heads, num_kv_heads), block_n=d // 2,
    )  # fmt: skip
    return q


def linear_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ w.T in one kernel: x [T, K], w [N, K], residual [T, N] -> [T, N] (the matmul's result
    rounded to the dtype first, as `residual + linear(x, w)` rounds it)."""
    x, residual = _rows(x, "linear_residual"), _rows(residual, "linear_residual")
    if residual.shape != (x.shape[0], w.shape[0]):
        raise ValueError(f"linear_residual: residual {tuple(residual.shape)} for {x.shape[0]} x {w.shape[0]}")
    y = torch.empty_like(residual)
    _fused_linear(x, w, RESIDUAL, w.shape[0], y, residual=residual)
    return y


def norm_gate_up_silu(x: torch.Tensor, norm_w: torch.Tensor, eps: float, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(rms_norm(x) @ gate_up.T) in one kernel: x [T, H], gate_up [2I, H] (gate rows, then up rows)
    -> [T, I]."""
    x = _rows(x, "norm_gate_up_silu")
    if gate_up.shape[0] % 2:
        raise ValueError(f"norm_gate_up_silu: gate_up has {gate_up.shape[0]} rows (gate and up: an even count)")
    inter = gate_up.shape[0] // 2
    y = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    _fused_linear(x, gate_up, SILU_MUL, inter, y, norm_w=norm_w, eps=eps)
    return y


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
