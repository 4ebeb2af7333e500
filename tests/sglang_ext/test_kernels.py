"""The AVX2 small-batch linear (sglang_ext/kernels/cpu_linear.cpp) against torch, and its batch invariance."""

import pytest
import torch
import torch.nn.functional as F

from sglang_ext import kernels
from sglang_ext.settings import reload_settings


def _has_avx2() -> bool:
    return {"avx2", "fma"} <= kernels._cpu_flags()


def test_kernel_is_built_and_used_on_avx2_machines():
    if not _has_avx2():
        pytest.skip("CPU without AVX2/FMA: the kernel is not used here")
    assert kernels.AVAILABLE, kernels.UNAVAILABLE
    assert kernels.uses_kernel(torch.randn(3, 16), torch.randn(5, 16))


@pytest.mark.skipif(not kernels.AVAILABLE, reason=f"kernel unavailable: {kernels.UNAVAILABLE}")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 17, 64])
@pytest.mark.parametrize("n,k", [(4, 8), (7, 24), (960, 576), (1539, 1536)])
def test_linear_small_matches_fp64_reference(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    ref = F.linear(x.double(), w.double())
    got = torch.ops.moa_cpu.linear_small(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # fp32 accumulation over k terms: error grows ~ sqrt(k) * eps * |x||w|
    assert (got.double() - ref).abs().max() <= 1e-5 * k**0.5 * 8, (got.double() - ref).abs().max()


@pytest.mark.skipif(not kernels.AVAILABLE, reason=f"kernel unavailable: {kernels.UNAVAILABLE}")
def test_rows_are_bit_identical_whatever_the_batch():
    """A decode row equals the same row inside a verify block (the engine's greedy identity leans on this)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 576, generator=g), torch.randn(1541, 576, generator=g)
    full = torch.ops.moa_cpu.linear_small(x, w)
    for i in range(13):
        assert torch.equal(torch.ops.moa_cpu.linear_small(x[i : i + 1], w)[0], full[i])
    # every blocking: one pass (<= 8 rows), groups of <= 6 (9-12 rows), groups of <= 3 (> 12 rows)
    for a, b in [(3, 9), (0, 7), (5, 13), (1, 11), (0, 12)]:
        assert torch.equal(torch.ops.moa_cpu.linear_small(x[a:b], w), full[a:b]), (a, b)


def test_linear_falls_back_to_torch_outside_the_kernel_shapes():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    big = torch.randn(kernels.SMALL_ROWS + 1, 16, generator=g)
    assert not kernels.uses_kernel(big, w)
    assert torch.equal(kernels.linear(big, w, b), F.linear(big, w, b))
    assert not kernels.uses_kernel(big[:2].bfloat16(), w.bfloat16())
    odd_k = torch.randn(2, 12, generator=g)
    assert not kernels.uses_kernel(odd_k, torch.randn(3, 12))
    xg = torch.randn(2, 16, generator=g, requires_grad=True)
    assert not kernels.uses_kernel(xg, w)
    kernels.linear(xg, w, b).sum().backward()  # autograd goes through F.linear
    assert torch.allclose(xg.grad, w.sum(0).expand(2, 16))
    small = torch.randn(3, 16, generator=g)
    assert torch.allclose(kernels.linear(small, w, b), F.linear(small, w, b), atol=1e-5)


@pytest.mark.skipif(not kernels.AVAILABLE, reason=f"kernel unavailable: {kernels.UNAVAILABLE}")
def test_linear_small_rejects_bad_input():
    with pytest.raises(RuntimeError, match="fp32 only"):
        torch.ops.moa_cpu.linear_small(torch.randn(2, 8).double(), torch.randn(3, 8).double())
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.moa_cpu.linear_small(torch.randn(2, 12), torch.randn(3, 12))
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        torch.ops.moa_cpu.linear_small(torch.randn(2, 8), torch.randn(3, 16))


def test_auto_dtype_is_fp32_where_the_kernels_run(monkeypatch):
    """--dtype auto: fp32 on a CPU with our kernels even when it has bf16 hardware (oneDNN's bf16
    decode was 3x slower than the kernels on a Xeon with AVX512-BF16); bf16 hardware without the
    kernels -> bf16; neither -> fp32; a GPU -> bf16."""
    from sglang_ext import models

    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(kernels, "AVAILABLE", True)
    assert models.parse_dtype("auto") == torch.float32
    monkeypatch.setattr(kernels, "AVAILABLE", False)
    assert models.parse_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: False)
    assert models.parse_dtype("auto") == torch.float32
    assert models.parse_dtype("auto", device="cuda") == torch.bfloat16


def test_kernel_row_limit_follows_the_cpu_and_the_environment(monkeypatch):
    """MKL takes forwards of more rows than SMALL_ROWS: 24 where the AVX-512 tiles run, else 128;
    MOA_SERVE_KERNEL_ROWS overrides it, and a bad value is a clear error, not a silent default."""
    monkeypatch.delenv("MOA_SERVE_KERNEL_ROWS", raising=False)
    reload_settings()
    assert kernels._kernel_rows() == (24 if kernels.AVX512 else 128)
    monkeypatch.setenv("MOA_SERVE_KERNEL_ROWS", "128")
    reload_settings()
    assert kernels._kernel_rows() == 128
    for bad in ("abc", "0", "-3", "2.5"):
        monkeypatch.setenv("MOA_SERVE_KERNEL_ROWS", bad)
        with pytest.raises(ValueError, match="MOA_SERVE_KERNEL_ROWS"):
            reload_settings()
            kernels._kernel_rows()
