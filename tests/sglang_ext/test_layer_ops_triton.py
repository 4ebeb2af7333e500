"""The GPU layer ops (sglang_ext/kernels/triton_layer_ops.py) against the torch formulas they replace, and the
fused matmuls against the ops they fuse.

On CPU the kernels only run under TRITON_INTERPRET=1, which must be set before `triton` is imported: the
checks run in a subprocess (as tests/sglang_ext/test_attention.py's do), and the kernels are also compiled
for sm_80 (no GPU needed). `python tests/sglang_ext/test_layer_ops_triton.py interpret` runs them by hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _rows_alone_dot() -> None:
    """The interpreter's tl.dot is numpy's matmul, whose BLAS kernel may sum a row differently by the row's place in
    the tile (OpenBLAS's AVX2 sgemm kernels: rows 6-15 of a 16-row tile); a GPU kernel's dot sums every row the same
    way wherever it sits. So that the rows-alone checks see our kernels' tiling and masks (a row that read another
    row's data would still differ), not the host BLAS's, each row of an interpreted dot is computed alone."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, precision, imprecise):
        if a.data.ndim != 2:
            return dot(self, a, b, d, precision, imprecise)
        row = lambda t, i: TensorHandle(t.data[i : i + 1], t.dtype)  # noqa: E731
        rows = [dot(self, row(a, i), b, row(d, i), precision, imprecise).data for i in range(len(a.data))]
        return TensorHandle(np.concatenate(rows), d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


def _run_cases() -> dict:
    """In the TRITON_INTERPRET=1 subprocess: per check, max |triton - torch| or a bool."""
    import torch.nn.functional as F
    from helpers import tiny_config, tiny_state

    from sglang_ext.attention import causal_mask, plan_attention
    from sglang_ext.kernels import triton_layer_ops as ops
    from sglang_ext.models import LlamaModel
    from sglang_ext.models.llama import apply_rope, rms_norm

    _rows_alone_dot()

    def rel(a, b) -> float:  # max |a - b| relative to |b| (at least 1): bf16 rounding is relative
        return ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1)).max().item()

    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        x, r = (torch.randn(7, 96, generator=g).to(dtype) for _ in range(2))
        w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
        out[f"rms_norm/{name}"] = rel(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
        rows = torch.cat([ops.rms_norm(x[i : i + 1], w, 1e-5) for i in range(7)])
        out[f"rms_norm_rows_alone/{name}"] = torch.equal(rows, ops.rms_norm(x, w, 1e-5))
        s, y = ops.add_rms_norm(x, r, w, 1e-5)
        out[f"add/{name}"] = rel(s, x.float() + r.float())
        out[f"add_rms_norm/{name}"] = rel(y, rms_norm(x + r, w, 1e-5))

        t, hq, hkv, d = 5, 6, 2, 16
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        ang = torch.randn(t, d // 2, generator=g)
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(dtype), torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
        k_pool, v_pool = (torch.randn(12, hkv, d, generator=g).to(dtype) for _ in range(2))
        k0, v0 = k_pool.clone(), v_pool.clone()
        slots = torch.tensor([3, 9, 1, 11, 6])
        q = ops.rope_store(qkv, cos, sin, k_pool, v_pool, slots, hq, hkv)
        qr, kr, vr = qkv.float().split([hq * d, hkv * d, hkv * d], dim=1)
        c, s_ = cos.float()[:, None], sin.float()[:, None]
        out[f"rope_q/{name}"] = rel(q, apply_rope(qr.view(t, hq, d), c, s_))
        out[f"rope_k/{name}"] = rel(k_pool[slots], apply_rope(kr.view(t, hkv, d), c, s_))
        out[f"store_v/{name}"] = torch.equal(v_pool[slots], vr.view(t, hkv, d).to(dtype))
        rest = torch.ones(12, dtype=torch.bool)
        rest[slots] = False
        out[f"other_slots_untouched/{name}"] = torch.equal(k_pool[rest], k0[rest]) and torch.equal(
            v_pool[rest], v0[rest]
        )

        gu = torch.randn(4, 2 * 40, generator=g).to(dtype)
        ref = F.silu(gu[:, :40].float()) * gu[:, 40:].float()
        out[f"silu_mul/{name}"] = rel(ops.silu_mul(gu), ref)

        # the fused matmuls against the glue ops and F.linear they fuse (19 rows: two row tiles, one partial;
        # K = 96 and 384: a partial K block; head dim 64)
        t, d, inter = 19, 64, 80
        x, h_in = torch.randn(t, 96, generator=g).to(dtype), torch.randn(t, 384, generator=g).to(dtype)
        qkv_w = (0.1 * torch.randn((hq + 2 * hkv) * d, 96, generator=g)).to(dtype)
        qkv_b = (0.1 * torch.randn((hq + 2 * hkv) * d, generator=g)).to(dtype)
        ang = torch.randn(t, d // 2, generator=g)
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(dtype), torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
        pools = [torch.randn(40, hkv, d, generator=g).to(dtype) for _ in range(2)]
        fused_pools, ref_pools = [p.clone() for p in pools], [p.clone() for p in pools]
        slots = torch.randperm(39, generator=g)[:t] + 1
        for bias in (None, qkv_b):
            tag = f"{'bias' if bias is not None else 'nobias'}/{name}"
            q = ops.norm_qkv_rope_store(x, w, 1e-5, qkv_w, bias, cos, sin, *fused_pools, slots, hq, hkv)
            qkv = F.linear(ops.rms_norm(x, w, 1e-5), qkv_w, bias)
            q_ref = ops.rope_store(qkv, cos, sin, *ref_pools, slots, hq, hkv)
            out[f"norm_qkv_rope_store_q/{tag}"] = rel(q, q_ref)
            out[f"norm_qkv_rope_store_kv/{tag}"] = max(rel(a, b) for a, b in zip(fused_pools, ref_pools))
        rest = torch.ones(40, dtype=torch.bool)
        rest[slots] = False
        out[f"fused_other_slots_untouched/{name}"] = all(
            torch.equal(a[rest], b[rest]) for a, b in zip(fused_pools, pools)
        )
        o_w = (0.1 * torch.randn(96, 384, generator=g)).to(dtype)
        out[f"linear_residual/{name}"] = rel(ops.linear_residual(h_in, o_w, x), x + F.linear(h_in, o_w))
        gu_w = (0.1 * torch.randn(2 * inter, 96, generator=g)).to(dtype)
        y = ops.norm_gate_up_silu(x, w, 1e-5, gu_w)
        out[f"norm_gate_up_silu/{name}"] = rel(y, ops.silu_mul(F.linear(ops.rms_norm(x, w, 1e-5), gu_w)))
        # rows alone: the batch's rows one at a time give the same bits
        rows = torch.cat([ops.norm_gate_up_silu(x[i : i + 1], w, 1e-5, gu_w) for i in range(t)])
        res_rows = torch.cat([ops.linear_residual(h_in[i : i + 1], o_w, x[i : i + 1]) for i in range(t)])
        out[f"fused_rows_alone/{name}"] = torch.equal(rows, y) and torch.equal(
            res_rows, ops.linear_residual(h_in, o_w, x)
        )

    # one decoder layer: the fused path against the torch path (fp32, the same weights, plan and pools)
    cfg = tiny_config(vocab=64, hidden=128, layers=2, heads=2, kv_heads=1)  # head dim 64: the fused kernels' fit
    model = LlamaModel(cfg, tiny_state(cfg, 1))
    n = 6
    x = torch.randn(n, cfg.hidden_size, generator=g)
    pos, slots = torch.arange(n), torch.arange(1, n + 1)
    plan = plan_attention([slots], [causal_mask(n, 0)])
    rope = model.rope(pos)
    kv_a, kv_b = model.new_kv_pool(16), model.new_kv_pool(16)
    lw = model.layers[0]
    kv_c = model.new_kv_pool(16)
    fused = model._layer_forward_fused(lw, x, rope, slots, plan, kv_a.k[0], kv_a.v[0])
    ref = model._layer_forward_torch(lw, x, rope, slots, plan, kv_b, 0)
    unfused = model._layer_forward_unfused(lw, x, rope, slots, plan, kv_c.k[0], kv_c.v[0])
    out["layer"] = (fused - ref).abs().max().item()
    out["layer_kv"] = max((kv_a.k[0] - kv_b.k[0]).abs().max().item(), (kv_a.v[0] - kv_b.v[0]).abs().max().item())
    out["layer_unfused"] = (fused - unfused).abs().max().item()
    out["layer_unfused_kv"] = max(
        (kv_a.k[0] - kv_c.k[0]).abs().max().item(), (kv_a.v[0] - kv_c.v[0]).abs().max().item()
    )
    return out


def _subprocess(arg: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), arg],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    proc = _subprocess("interpret", {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# relative to the value: fp32 rounding; for bf16 a few roundings of 2^-8 (the result's, the torch side's
# per-op ones, and the interpreter's own: it has no bf16 arithmetic, its conversions are numpy's)
TOL = {"float32": 2e-6, "bfloat16": 2**-5}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("op", ["rms_norm", "add", "add_rms_norm", "rope_q", "rope_k", "silu_mul"])
def test_triton_layer_op_equals_the_torch_formula(interpreted, op, dtype):
    assert interpreted[f"{op}/{dtype}"] <= TOL[dtype], interpreted


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("check", ["rms_norm_rows_alone", "store_v", "other_slots_untouched"])
def test_triton_layer_ops_exact_parts(interpreted, check, dtype):
    """A row's norm does not depend on the rows beside it; the V store is a copy; the pools change only
    at the given slots."""
    assert interpreted[f"{check}/{dtype}"] is True, interpreted


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "op",
    ["norm_qkv_rope_store_q/bias", "norm_qkv_rope_store_kv/bias", "norm_qkv_rope_store_q/nobias"]
    + ["norm_qkv_rope_store_kv/nobias", "linear_residual", "norm_gate_up_silu"],
)
def test_a_fused_matmul_equals_the_ops_it_fuses(interpreted, op, dtype):
    """Each fused matmul (norm, matmul and epilogue in one kernel) against the glue kernels and F.linear it
    replaces: the same values up to the sums' order (fp32), or a couple of bf16 roundings (a matmul's output
    rounded on either side of a tie, then the residual's sum)."""
    tol = {"float32": 1e-5, "bfloat16": TOL["bfloat16"]}[dtype]
    assert interpreted[f"{op}/{dtype}"] <= tol, interpreted


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("check", ["fused_rows_alone", "fused_other_slots_untouched"])
def test_fused_matmuls_exact_parts(interpreted, check, dtype):
    """A fused matmul's row does not depend on the rows beside it (19 rows = 16 + 3, each alone: the same
    bits); the pools change only at the given slots."""
    assert interpreted[f"{check}/{dtype}"] is True, interpreted


def test_a_fused_layer_equals_the_torch_layer_and_the_unfused_one(interpreted):
    """The five-kernel layer against the torch ops and against the ten glue kernels (fp32): output and K/V."""
    assert interpreted["layer"] < 1e-4 and interpreted["layer_kv"] < 1e-5, interpreted
    assert interpreted["layer_unfused"] < 1e-4 and interpreted["layer_unfused_kv"] < 1e-5, interpreted


def test_triton_layer_ops_compile_for_gpu():
    """The interpreter is lenient about types; compile every kernel for sm_80 too (no GPU needed)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    proc = _subprocess("compile", {})
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]


def _compile_for_sm80() -> int:
    """Exit code 0 = compiled, 3 = no CUDA toolchain here (skip)."""
    import triton

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        print("triton has no nvidia backend")
        return 3
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_ext.kernels import triton_layer_ops as ops

    def signature(kernel, ptrs: dict, consts: dict) -> ASTSource:
        sig = {
            n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n == "eps" else "i32")
            for n in kernel.arg_names
        }
        return ASTSource(kernel, sig, {(kernel.arg_names.index(n),): v for n, v in consts.items()})

    bf16 = "*bf16"
    sources = [
        signature(ops._rms_norm_kernel, dict.fromkeys("XRWYS", bf16), {"ADD": add, "BLOCK": 1024})
        for add in (False, True)
    ]
    ptrs = dict.fromkeys(["QKV", "COS", "SIN", "Q", "K", "V"], bf16) | {"SLOTS": "*i64"}
    sources.append(signature(ops._rope_store_kernel, ptrs, {"NUM_HEADS": 9, "NUM_KV_HEADS": 3, "HALF": 32}))
    sources.append(signature(ops._silu_mul_kernel, {"GU": bf16, "Y": bf16}, {"BLOCK": 1024}))
    # the fused matmul in each epilogue, bf16 (tensor-core dots) and fp32 (IEEE dots)
    for dtype, ieee in (("*bf16", False), ("*fp32", True)):
        ptrs = dict.fromkeys(["X", "W", "BIAS", "NW", "R", "Y", "COS", "SIN", "KP", "VP"], dtype) | {"SLOTS": "*i64"}
        for epi, block_n in ((ops.PLAIN, 64), (ops.RESIDUAL, 64), (ops.SILU_MUL, 64), (ops.ROPE_STORE, 32)):
            consts = {"NORM": epi in (ops.SILU_MUL, ops.ROPE_STORE), "HAS_BIAS": epi == ops.ROPE_STORE, "EPI": epi}
            consts |= {"PAIR": epi in (ops.SILU_MUL, ops.ROPE_STORE), "NUM_HEADS": 9, "NUM_KV_HEADS": 3}
            consts |= {"IEEE": ieee, "BLOCK_M": ops.BLOCK_M, "BLOCK_N": block_n, "BLOCK_K": ops.BLOCK_K}
            sources.append(signature(ops._fused_linear_kernel, ptrs, consts))
    try:
        for src in sources:
            triton.compile(src, target=GPUTarget("cuda", 80, 32))
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e):
            print(f"ptxas unavailable: {e}")
            return 3
        raise
    return 0


@pytest.mark.gpu
def test_gpu_fused_layer_equals_the_torch_layer():
    """On CUDA, bf16 and fp32: one decoder layer through the Triton ops against the torch ops."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from helpers import smollm2_config

    from sglang_ext.attention import causal_mask, plan_attention
    from sglang_ext.models.synthetic import random_target

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        model = random_target(smollm2_config(), "cuda", dtype=dtype)
        n = 40
        x = torch.randn(n, 576, device="cuda", dtype=dtype)
        slots = torch.arange(1, n + 1, device="cuda")
        plan = plan_attention([slots], [causal_mask(n, 0)], device="cuda")
        rope = model.rope(torch.arange(n, device="cuda"))
        kv_a, kv_b = model.new_kv_pool(64), model.new_kv_pool(64)
        fused = model._layer_forward_fused(model.layers[0], x, rope, slots, plan, kv_a.k[0], kv_a.v[0])
        torch_ops = model._layer_forward_torch(model.layers[0], x, rope, slots, plan, kv_b, 0)
        assert (fused.float() - torch_ops.float()).abs().max().item() < tol
        kv_c = model.new_kv_pool(64)
        unfused = model._layer_forward_unfused(model.layers[0], x, rope, slots, plan, kv_c.k[0], kv_c.v[0])
        assert (fused.float() - unfused.float()).abs().max().item() < tol


@pytest.mark.gpu
def test_gpu_fused_matmuls_compute_each_row_alone():
    """On CUDA in bf16 (tensor-core dots): each fused matmul's rows are the same bits computed one at a time
    as in a batch of 40 (greedy identity needs a verify row to be its decode's arithmetic)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from helpers import smollm2_config

    from sglang_ext.kernels import triton_layer_ops as ops
    from sglang_ext.models.synthetic import random_target

    c = smollm2_config()
    model = random_target(c, "cuda", dtype=torch.bfloat16)
    lw, n = model.layers[0], 40
    x = torch.randn(n, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(n, c.num_heads * c.head_dim, device="cuda", dtype=torch.bfloat16)
    rope = model.rope(torch.arange(n, device="cuda"))
    cos, sin = rope[0][:, 0], rope[1][:, 0]
    slots = torch.arange(1, n + 1, device="cuda")
    pools = [model.new_kv_pool(64) for _ in range(2)]

    def qkv(i: slice, kv) -> torch.Tensor:
        w = (x[i], lw.input_norm, c.rms_norm_eps, lw.qkv, lw.qkv_bias, cos[i], sin[i], kv.k[0], kv.v[0], slots[i])
        return ops.norm_qkv_rope_store(*w, c.num_heads, c.num_kv_heads)

    alone = torch.cat([qkv(slice(j, j + 1), pools[0]) for j in range(n)])
    assert torch.equal(alone, qkv(slice(0, n), pools[1])) and torch.equal(pools[0].k[0], pools[1].k[0])
    for f in (
        lambda i: ops.linear_residual(a[i], lw.o, x[i]),
        lambda i: ops.norm_gate_up_silu(x[i], lw.post_norm, c.rms_norm_eps, lw.gate_up),
    ):
        assert torch.equal(torch.cat([f(slice(j, j + 1)) for j in range(n)]), f(slice(0, n)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
    if sys.argv[1:] == ["interpret"]:
        print(json.dumps(_run_cases()))
    elif sys.argv[1:] == ["compile"]:
        sys.exit(_compile_for_sm80())
    else:
        sys.exit(f"usage: {sys.argv[0]} interpret | compile")
