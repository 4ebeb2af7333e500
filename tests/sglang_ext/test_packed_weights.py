"""GGUF block weights (Q4_1 / Q8_0) read by the CPU kernel: the same numbers as the fp32 weights, bit for bit."""

import shutil

import pytest
import torch
from helpers import gguf_dequant, random_blocks
from safetensors.torch import save_file

from sglang_ext import kernels
from sglang_ext.attention import causal_mask, plan_attention
from sglang_ext.models.loader import (
    PACKED_FILE,
    load_packed_weights,
    load_state_dict,
    resolve_target,
    smollm2_gguf_path,
    write_packed_weights,
)

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason=f"kernel unavailable: {kernels.UNAVAILABLE}")


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_dequantize_matches_gguf_exactly(kind):
    blocks = random_blocks(kind, 37, 96, seed=1)
    got = torch.ops.moa_cpu.dequantize_packed(blocks, kernels.PACKED_KIND_IDS[kind], 96)
    assert torch.equal(got, gguf_dequant(kind, blocks))


@pytest.mark.parametrize("simd", ["best", "avx2"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20, 24, 25, 33, 64, 128])
def test_linear_packed_equals_linear_small_on_the_dequantized_weights(kind, m, simd, request):
    """Bit for bit, whatever the rows: the packed path changes the bytes read, not the sums. "best"
    runs the AVX-512 tiles where the CPU has them (3-24 rows), "avx2" the AVX2 ones everywhere."""
    if simd == "avx2":
        torch.ops.moa_cpu.set_avx512(False)
        request.addfinalizer(lambda: torch.ops.moa_cpu.set_avx512(kernels.AVX512))
    n, k = 51, 576  # n odd (a last single row), not a multiple of the 24 / 4 row blocks
    blocks = random_blocks(kind, n, k, seed=m)
    w = gguf_dequant(kind, blocks)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = torch.ops.moa_cpu.linear_packed(x, blocks, kernels.PACKED_KIND_IDS[kind])
    assert torch.equal(got, torch.ops.moa_cpu.linear_small(x, w))
    assert torch.equal(
        got[m // 2], torch.ops.moa_cpu.linear_packed(x[m // 2 : m // 2 + 1], blocks, kernels.PACKED_KIND_IDS[kind])[0]
    )


def test_linear_dispatches_to_attached_blocks_and_checks_them():
    blocks = random_blocks("Q4_1", 24, 64, seed=3)
    w = gguf_dequant("Q4_1", blocks)
    w_packed = w.clone()
    kernels.attach_packed(w_packed, "Q4_1", blocks)
    x = torch.randn(4, 64)
    assert torch.equal(kernels.linear(x, w_packed), kernels.linear(x, w))
    # the blocks really are what is read: attach other blocks and the result changes
    other = w.clone()
    kernels.attach_packed(other, "Q4_1", random_blocks("Q4_1", 24, 64, seed=4))
    assert not torch.equal(kernels.linear(x, other), kernels.linear(x, w))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.attach_packed(w.clone(), "Q8_0", blocks)
    with pytest.raises(ValueError, match="unsupported packed kind"):
        kernels.attach_packed(w.clone(), "Q5_K", blocks)


def test_kernel_rejects_bad_inputs_clearly():
    blocks = random_blocks("Q4_1", 8, 64, seed=5)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        torch.ops.moa_cpu.linear_packed(torch.randn(2, 96), blocks, 0)  # K of x does not fit the blocks
    with pytest.raises(RuntimeError, match="kind must be"):
        torch.ops.moa_cpu.linear_packed(torch.randn(2, 64), blocks, 7)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.moa_cpu.linear_packed(torch.randn(2, 40), blocks, 0)


def test_shipped_target_blocks_are_its_fp32_weights(smollm2_fp32):
    """Every linear weight and the (tied) embedding of the default target carry their GGUF blocks, which
    dequantize to exactly the fp32 weights the model holds (rows in the same order: q/k are permuted)."""
    model = smollm2_fp32.model
    layer = model.layers[0]
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head):
        kind, blocks, _ = w.moa_packed
        assert torch.equal(torch.ops.moa_cpu.dequantize_packed(blocks, kind, w.shape[1]), w)
    assert all(hasattr(lw.qkv, "moa_packed") and hasattr(lw.down, "moa_packed") for lw in model.layers)


def test_packed_and_fp32_decode_give_identical_logits(smollm2_fp32, monkeypatch):
    model = smollm2_fp32.model
    ids = smollm2_fp32.encode_chat([{"role": "user", "content": "Name three primes."}])

    def step_logits():
        kv = model.new_kv_pool(len(ids) + 8)
        slots = torch.arange(len(ids))
        model.forward(
            torch.tensor(ids[:-1]),
            torch.arange(len(ids) - 1),
            slots[:-1],
            plan_attention([slots[:-1]], [causal_mask(len(ids) - 1, 0)]),
            kv,
        )
        # the last token as a decode step (1 row: the kernel path) over the cached prompt
        out = model.forward(
            torch.tensor(ids[-1:]),
            torch.tensor([len(ids) - 1]),
            slots[-1:],
            plan_attention([slots], [causal_mask(1, len(ids) - 1)]),
            kv,
        )
        return model.logits(out.hidden, fp32=False)

    packed = step_logits()
    monkeypatch.setattr(kernels, "PACKED", False)
    assert torch.equal(packed, step_logits())


def test_writer_keeps_only_tensors_whose_blocks_match_exactly(tmp_path):
    """A weight that is not exactly its GGUF blocks' dequantization (here: one element nudged by an
    ulp) keeps its fp32 copy only; the others are packed with rows in the fp32 order."""
    state = load_state_dict(resolve_target("smollm2"))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    nudged = state[k].clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(1.0))
    save_file({q: state[q], k: nudged}, tmp_path / "model.safetensors")
    write_packed_weights(smollm2_gguf_path(), tmp_path)
    packed = load_packed_weights(tmp_path)
    assert set(packed) == {q} and (tmp_path / PACKED_FILE).is_file()
    kind, blocks = packed[q]
    assert (
        kind == "Q4_1"
        and torch.equal(torch.ops.moa_cpu.dequantize_packed(blocks, 0, q_cols := state[q].shape[1]), state[q])
        and q_cols == 576
    )


# --- bf16 halves: a drafter checkpoint saved in bf16 and run in fp32 -------------------------------
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 64])
def test_bf16_halves_give_the_fp32_sums(m):
    """A weight whose values are bf16 values: reading its bf16 halves gives linear_small's sums, bit for bit."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(51, 576, generator=g).bfloat16().float()  # an odd row count: pairs of rows, then one
    x = torch.randn(m, 576, generator=g)
    halves = w.bfloat16().view(torch.uint8).reshape(51, -1)
    got = torch.ops.moa_cpu.linear_packed(x, halves, kernels.PACKED_KIND_IDS["BF16"])
    assert torch.equal(got, torch.ops.moa_cpu.linear_small(x, w))
    assert torch.equal(torch.ops.moa_cpu.dequantize_packed(halves, kernels.PACKED_KIND_IDS["BF16"], 576), w)


def test_bf16_halves_attach_only_to_exact_weights_and_go_stale_on_update():
    exact, inexact = torch.nn.Linear(64, 24, bias=False), torch.nn.Linear(64, 24, bias=False)
    with torch.no_grad():
        exact.weight.copy_(exact.weight.bfloat16().float())
        inexact.weight.copy_(exact.weight + 1e-4)  # not representable in bf16
    assert kernels.attach_bf16_halves(torch.nn.Sequential(exact, inexact)) == 1
    assert hasattr(exact.weight, "moa_packed") and not hasattr(inexact.weight, "moa_packed")
    x = torch.randn(2, 64)
    with torch.no_grad():  # (with autograd on, linear is F.linear)
        assert kernels._packed(exact.weight) is not None
        assert torch.equal(kernels.linear(x, exact.weight), torch.ops.moa_cpu.linear_small(x, exact.weight))
        # an in-place update (an optimizer step) makes the halves stale: linear reads the fp32 weight again
        exact.weight.mul_(1.5)
        assert kernels._packed(exact.weight) is None
        assert torch.equal(kernels.linear(x, exact.weight), torch.ops.moa_cpu.linear_small(x, exact.weight))


def test_shipped_drafters_read_bf16_halves(smollm2_fp32):
    """The shipped EAGLE-3 head is a bf16 checkpoint: every matmul weight of the drafter carries its halves."""
    from sglang_ext.drafters import make_drafter

    d = make_drafter("eagle3", smollm2_fp32)
    linears = [m for m in d.draft.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(
        kernels._packed(m.weight) is not None and m.weight.moa_packed[0] == kernels.PACKED_KIND_IDS["BF16"]
        for m in linears
    )


def test_packed_rows_of_a_weight_give_its_rows_sums():
    blocks = random_blocks("Q8_0", 40, 64, seed=6)
    w = gguf_dequant("Q8_0", blocks)
    kernels.attach_packed(w, "Q8_0", blocks)
    rows = torch.tensor([3, 17, 0, 39, 8])
    sub = w[rows].contiguous()
    kernels.attach_packed_rows(sub, w, rows)
    assert kernels._packed(sub) is not None
    x = torch.randn(3, 64)
    assert torch.equal(kernels.linear(x, sub), torch.ops.moa_cpu.linear_small(x, w[rows].contiguous()))
    with pytest.raises(ValueError, match="is not 5 rows"):
        kernels.attach_packed_rows(torch.zeros(4, 64), w, rows)


def test_moa_draft_head_reads_the_targets_blocks(smollm2_fp32):
    """The MoA drafter's draft-vocab slice of the target's lm_head reads the matching Q8_0 rows."""
    from sglang_ext.drafters import make_drafter

    d = make_drafter("moa-tli1", smollm2_fp32)
    kind, blocks, _ = kernels._packed(d.head)
    assert kind == kernels.PACKED_KIND_IDS["Q8_0"] and torch.equal(
        torch.ops.moa_cpu.dequantize_packed(blocks, kind, d.head.shape[1]), d.head
    )


def test_blocks_attach_to_inference_tensors_too():
    """A weight made under inference_mode keeps no version counter: its blocks are used as attached."""
    with torch.inference_mode():
        w = torch.randn(24, 64).bfloat16().float()
        kernels.attach_packed(w, "BF16", w.bfloat16().view(torch.uint8).reshape(24, -1))
        x = torch.randn(2, 64)
        assert kernels._packed(w) is not None
        assert torch.equal(kernels.linear(x, w), torch.ops.moa_cpu.linear_small(x, w))


def test_a_second_converter_keeps_the_finished_cache_and_leaves_no_temp_files(tmp_path, smollm2_fp32):
    """Two processes converting the default target at once (a server and a trainer on a fresh
    machine): each writes its own temp dir, the later one finds the cache complete and steps aside.
    The winner's cache is the session's converted target (this converter's output), copied."""
    from sglang_ext.models.loader import convert_gguf

    out = tmp_path / "SmolLM2-135M-Instruct"
    shutil.copytree(smollm2_fp32.path, out, ignore=shutil.ignore_patterns(PACKED_FILE))
    first = (out / "model.safetensors").stat().st_mtime_ns
    convert_gguf(smollm2_gguf_path(), out)  # the loser of the race
    assert (out / "model.safetensors").stat().st_mtime_ns == first and (out / "config.json").is_file()
    write_packed_weights(smollm2_gguf_path(), out)
    write_packed_weights(smollm2_gguf_path(), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")] and (out / PACKED_FILE).is_file()
