"""Tree attention: the Triton kernel against the torch reference, and metamorphic tests of the reference.

The Triton checks run in subprocesses: on CPU the kernel only runs under TRITON_INTERPRET=1, which must
be set before `triton` is imported, and setting it here would change every later triton import in this
pytest process. `python tests/sglang_ext/test_attention.py triton-parity` runs the parity cases by hand.
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
import torch.nn.functional as F

from sglang_ext.attention import causal_mask, plan_attention, prefix_and_tree_mask, tree_attention_torch
from sglang_ext.tree import TokenTree, tree_from_parents

REPO = Path(__file__).resolve().parents[2]


# --- helpers ------------------------------------------------------------------------------------


def random_tree(n: int, prefix_len: int, gen: torch.Generator) -> TokenTree:
    """A tree of n nodes with uniformly random parents (parents[i] < i)."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    return tree_from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents), prefix_len)


def random_pools(num_slots: int, num_kv_heads: int, head_dim: int, gen: torch.Generator, dtype=torch.float32):
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k, v


def random_tree_batch(prefix_lens: list[int], tree_sizes: list[int], num_slots: int, gen: torch.Generator):
    """Per request: (kv slots = prefix then tree nodes, [N, prefix+N] mask, tree); slots are disjoint and shuffled."""
    perm = torch.randperm(num_slots, generator=gen)
    requests, used = [], 0
    for prefix, n in zip(prefix_lens, tree_sizes):
        tree = random_tree(n, prefix, gen)
        slots = perm[used : used + prefix + n]
        used += prefix + n
        requests.append((slots, prefix_and_tree_mask(tree.tree_mask, prefix), tree))
    return requests


# --- Triton kernel == torch reference (subprocess, TRITON_INTERPRET=1) -------------------------------

# (name, dtype, head_dim, prefix lengths, tree sizes, tolerance)
PARITY_CASES = [
    ("fp32-gqa-seed0", "float32", 64, [0, 5, 37, 70], [1, 7, 16, 33], 1e-5),
    ("fp32-gqa-seed1", "float32", 64, [12, 3, 50], [24, 2, 17], 1e-5),
    ("fp32-single-request", "float32", 64, [45], [40], 1e-5),
    ("fp32-head-dim-80", "float32", 80, [9, 31], [11, 5], 1e-5),
    ("bf16-gqa", "bfloat16", 64, [20, 0, 33], [8, 19, 4], 2e-2),
]


def _run_parity_cases() -> list[dict]:
    """Runs in the TRITON_INTERPRET=1 subprocess: max |triton - torch| per case."""
    from sglang_ext.attention.triton_tree import tree_attention_triton

    results = []
    for seed, (name, dtype_name, head_dim, prefixes, sizes, tol) in enumerate(PARITY_CASES):
        gen = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, dtype_name)
        requests = random_tree_batch(prefixes, sizes, num_slots=sum(prefixes) + sum(sizes) + 23, gen=gen)
        plan = plan_attention([r[0] for r in requests], [r[1] for r in requests])
        k_pool, v_pool = random_pools(sum(prefixes) + sum(sizes) + 23, 2, head_dim, gen, dtype)
        q = torch.randn(plan.num_queries, 6, head_dim, generator=gen).to(dtype)  # GQA: 3 q heads per kv head
        scale = head_dim**-0.5
        out = tree_attention_triton(q, k_pool, v_pool, plan, scale)
        ref = tree_attention_torch(q, k_pool, v_pool, plan, scale)
        diff = (out.float() - ref.float()).abs().max().item()
        results.append({"name": name, "max_diff": diff, "tol": tol, "dtype": str(out.dtype), "shape": list(out.shape)})
    return results


# (name, dtype, prefix lengths, tree sizes, padded requests, node bucket, context bucket)
STATIC_CASES = [
    ("fp32-decode-rows", "float32", [40, 7, 33], [1, 1, 1], 1, 1, 64),
    ("fp32-trees", "float32", [0, 45, 70, 3], [5, 16, 9, 1], 0, 16, 128),
    ("bf16-trees", "bfloat16", [20, 64, 31], [12, 3, 8], 1, 16, 64),
]


def _run_static_cases(device: str = "cpu") -> list[dict]:
    """Per case, whether the padded (static) form of the kernel gives every real row exactly the ragged
    form's output, with the graph runner's static_plan (on CPU: in the TRITON_INTERPRET=1 subprocess)."""
    from sglang_ext.attention.triton_tree import tree_attention_static, tree_attention_triton
    from sglang_ext.models.graph_runner import static_plan

    results = []
    for seed, (name, dtype_name, prefixes, sizes, pad_b, qb, pb) in enumerate(STATIC_CASES):
        gen = torch.Generator().manual_seed(100 + seed)
        dtype = getattr(torch, dtype_name)
        num_slots = sum(prefixes) + sum(sizes) + 23
        requests = random_tree_batch(prefixes, sizes, num_slots=num_slots, gen=gen)
        plan = plan_attention([r[0] for r in requests], [r[1] for r in requests])
        k_pool, v_pool = random_pools(num_slots, 2, 64, gen, dtype)
        q = torch.randn(plan.num_queries, 6, 64, generator=gen).to(dtype)

        b = len(requests) + pad_b  # padded requests: prefix_len 0, their rows see only themselves
        prefix, prefix_len = torch.zeros(b, pb, dtype=torch.long), torch.zeros(b, dtype=torch.long)
        extra, mask = torch.zeros(b, qb, dtype=torch.long), torch.eye(qb, dtype=torch.bool).repeat(b, 1, 1)
        qs = torch.randn(b * qb, 6, 64, generator=gen).to(dtype)  # padded rows: noise
        rows = []
        for i, ((slots, _, tree), p_len, n) in enumerate(zip(requests, prefixes, sizes)):
            prefix[i, :p_len], prefix_len[i], extra[i, :n] = slots[:p_len], p_len, slots[p_len:]
            mask[i, :n, :n] = tree.tree_mask
            rows += range(i * qb, i * qb + n)
        qs[rows] = q
        plan, k_pool, v_pool, q, qs = plan.on(device), k_pool.to(device), v_pool.to(device), q.to(device), qs.to(device)
        ref = tree_attention_triton(q, k_pool, v_pool, plan, 0.125)
        sp = static_plan(*(t.to(device) for t in (prefix, prefix_len, extra, mask)))
        out = tree_attention_static(qs, k_pool, v_pool, sp.slots, sp.allowed, sp.kv_len, 0.125)
        results.append(
            {"name": name, "exact": torch.equal(out[rows], ref), "max_diff": (out[rows] - ref).abs().max().item()}
        )
    return results


def _subprocess(args: list[str], env_extra: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The kernel's checks under TRITON_INTERPRET=1, in one subprocess (one import of torch and triton)."""
    if importlib.util.find_spec("triton") is None:  # find_spec of a top-level name does not import it
        pytest.skip("triton not installed")
    proc = _subprocess(["triton-interpret"], {"TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def triton_parity(interpreted) -> dict[str, dict]:
    return {r["name"]: r for r in interpreted["parity"]}


@pytest.mark.parametrize("case", [c[0] for c in PARITY_CASES])
def test_triton_matches_torch_reference(triton_parity, case):
    r = triton_parity[case]
    assert r["max_diff"] <= r["tol"], r


@pytest.fixture(scope="module")
def triton_static(interpreted) -> dict[str, dict]:
    return {r["name"]: r for r in interpreted["static"]}


@pytest.mark.parametrize("case", [c[0] for c in STATIC_CASES])
def test_triton_static_form_equals_the_ragged_call_bit_for_bit(triton_static, case):
    """A CUDA graph's attention (padded batch, bucketed rows and columns, lengths on the device) gives
    each real row exactly what the eager forward's ragged call gives it: graphs == eager."""
    assert triton_static[case]["exact"], triton_static[case]


def _run_tree_rows_case() -> list:
    """In the TRITON_INTERPRET=1 subprocess: a verify tree's rows against decoding their tokens alone,
    every layer, through the Triton kernel (fp32 target of two layers)."""
    from helpers import tiny_config, tiny_state, tree_rows_against_decodes

    from sglang_ext.attention.triton_tree import tree_attention_triton
    from sglang_ext.models import LlamaModel

    cfg = tiny_config(vocab=300, hidden=64, layers=2, heads=4, kv_heads=2)
    model = LlamaModel(cfg, tiny_state(cfg, 1), attention=tree_attention_triton)
    # a prompt of 60: the chain's columns fall on both sides of the kernel's 64-column block boundary
    return tree_rows_against_decodes(model, "ragged-eager", n_prompt=60, chain=6)


def test_triton_a_tree_row_equals_its_decode_bit_for_bit(interpreted):
    """The kernel's half of lossless greedy decoding: a tree node's row (ancestors interleaved with
    siblings it must not see) computes what decoding its token alone computes, bit for bit, at every
    layer. A kernel that sums masked columns as zeros in their tree positions fails this (the CPU
    backend's blocked attention does, within 5e-6)."""
    diffs = interpreted["tree_rows"]
    assert diffs == [], f"(chain position, first differing layer, max |diff|): {diffs}"


@pytest.mark.gpu
def test_gpu_triton_static_form_equals_the_ragged_call_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    results = _run_static_cases("cuda")
    assert all(r["exact"] for r in results), results


def test_triton_kernel_compiles_for_gpu():
    """The interpreter is lenient about types; also compile the kernel for sm_80 (no GPU needed)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    proc = _subprocess(["triton-compile"], {})
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

    from sglang_ext.attention.triton_tree import BLOCK_N
    from sglang_ext.attention.triton_tree import _row_attention_kernel as kernel

    ptrs = {name: "*bf16" for name in ("Q", "K", "V", "O")}
    ptrs |= {name: "*i64" for name in ("kv_indices", "cols", "seg_start", "kv_start", "count")}
    consts = {"GROUP": 3, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_N": BLOCK_N}
    signature = {}
    for name in kernel.arg_names:
        signature[name] = ptrs.get(name) or ("constexpr" if name in consts else "fp32" if name == "scale" else "i32")
    try:  # one kernel for the ragged (eager) and the padded (CUDA graph) form
        src = ASTSource(kernel, signature, {(kernel.arg_names.index(n),): v for n, v in consts.items()})
        triton.compile(src, target=GPUTarget("cuda", 80, 32))
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e):  # toolchain missing here: nothing to say about the kernel
            print(f"ptxas unavailable: {e}")
            return 3
        raise
    return 0


# --- metamorphic tests of the torch reference ------------------------------------------------------

HQ, HKV, D = 9, 3, 64
SCALE = D**-0.5


def test_chain_tree_equals_causal_attention():
    gen = torch.Generator().manual_seed(10)
    prefix, n = 13, 6
    chain = tree_from_parents(torch.zeros(n, dtype=torch.long), torch.arange(-1, n - 1), prefix)
    mask = prefix_and_tree_mask(chain.tree_mask, prefix)
    assert torch.equal(mask, causal_mask(n, prefix))

    k_pool, v_pool = random_pools(prefix + n, HKV, D, gen)
    q_all = torch.randn(prefix + n, HQ, D, generator=gen)  # queries of the whole sequence
    out = tree_attention_torch(
        q_all[prefix:], k_pool, v_pool, plan_attention([torch.arange(prefix + n)], [mask]), SCALE
    )

    def heads_first(x):  # [T, H, D] -> [H, T, D] with kv heads repeated for GQA
        return x.repeat_interleave(HQ // x.shape[1], dim=1).transpose(0, 1)

    causal = F.scaled_dot_product_attention(
        heads_first(q_all), heads_first(k_pool), heads_first(v_pool), is_causal=True, scale=SCALE
    )
    torch.testing.assert_close(out, causal.transpose(0, 1)[prefix:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_attention_equals_decoding_each_branch_alone(seed):
    gen = torch.Generator().manual_seed(seed)
    prefix, n = 11, 15
    ((slots, mask, tree),) = random_tree_batch([prefix], [n], num_slots=prefix + n + 5, gen=gen)
    k_pool, v_pool = random_pools(prefix + n + 5, HKV, D, gen)
    q = torch.randn(n, HQ, D, generator=gen)
    out = tree_attention_torch(q, k_pool, v_pool, plan_attention([slots], [mask]), SCALE)

    leaves = [i for i in range(n) if int(tree.retrieve_next_token[i]) == -1]
    for leaf in leaves:
        path = torch.tensor(tree.path_to(leaf))  # root .. leaf: one branch, decoded as a plain sequence
        branch_slots = torch.cat([slots[:prefix], slots[prefix + path]])
        branch_plan = plan_attention([branch_slots], [causal_mask(len(path), prefix)])
        branch_out = tree_attention_torch(q[path], k_pool, v_pool, branch_plan, SCALE)
        torch.testing.assert_close(out[path], branch_out, atol=1e-5, rtol=1e-5)


def test_padded_batch_equals_each_request_alone():
    gen = torch.Generator().manual_seed(7)
    prefixes, sizes = [0, 21, 4, 9], [5, 1, 12, 7]
    requests = random_tree_batch(prefixes, sizes, num_slots=80, gen=gen)
    # one request with a plain causal mask, so the batch mixes trees and sequences
    requests[3] = (requests[3][0], causal_mask(sizes[3], prefixes[3]), None)
    k_pool, v_pool = random_pools(80, HKV, D, gen)
    plan = plan_attention([r[0] for r in requests], [r[1] for r in requests])
    # a host plan's padded view is built where a backend first reads it (the native CPU kernels read the ragged one)
    assert callable(plan._groups)
    q = torch.randn(plan.num_queries, HQ, D, generator=gen)
    out = tree_attention_torch(q, k_pool, v_pool, plan, SCALE)
    assert out.shape == q.shape and torch.isfinite(out).all() and not callable(plan._groups)

    for b, (slots, mask, _) in enumerate(requests):
        rows = slice(int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1]))
        alone = tree_attention_torch(q[rows], k_pool, v_pool, plan_attention([slots], [mask]), SCALE)
        torch.testing.assert_close(out[rows], alone, atol=1e-5, rtol=1e-5)


def test_length_buckets_bound_padding():
    from sglang_ext.attention.plan import length_buckets

    assert length_buckets([10, 14, 12]) == [[0, 1, 2]]  # all within 1.5x: one group, batch order
    assert length_buckets([300, 10, 14, 1200, 16, 400]) == [[1, 2], [4], [0, 5], [3]]
    groups = length_buckets([1 + (i * 37) % 500 for i in range(64)])
    assert sorted(i for g in groups for i in g) == list(range(64))


@pytest.mark.parametrize("small_q", [0, 64])  # 0: every group through SDPA; 64: matmul path for trees
def test_bucketed_batch_equals_one_padded_group(small_q, monkeypatch):
    """Requests of very different lengths (prefill-sized and decode-sized queries) give the same
    output whether bucketed by length or padded as one group, through either attention path."""
    from sglang_ext.attention import torch_ref

    monkeypatch.setattr(torch_ref, "SMALL_Q", small_q)
    gen = torch.Generator().manual_seed(3)
    prefixes, sizes = [300, 0, 7, 90, 2, 40], [1, 80, 16, 1, 9, 70]
    requests = random_tree_batch(prefixes, sizes, num_slots=700, gen=gen)
    k_pool, v_pool = random_pools(700, HKV, D, gen)
    slots, masks = [r[0] for r in requests], [r[1] for r in requests]
    bucketed = plan_attention(slots, masks)
    one = plan_attention(slots, masks, waste=float("inf"))
    assert len(bucketed.groups) > 1 and len(one.groups) == 1
    # the prompt-sized blocks (80, 70 queries) are never padded together with the decode-sized ones
    assert all(len({bool(q > 64) for q in g.q_valid.sum(1).tolist()}) == 1 for g in bucketed.groups)
    q = torch.randn(bucketed.num_queries, HQ, D, generator=gen)
    torch.testing.assert_close(
        tree_attention_torch(q, k_pool, v_pool, bucketed, SCALE),
        tree_attention_torch(q, k_pool, v_pool, one, SCALE),
        atol=1e-5,
        rtol=1e-5,
    )


def test_frontier_plan_equals_one_plan_per_node():
    """A drafter step planned per request (prefix gathered once, each node masked to its own path, the
    paths tracked by FrontierPaths from each pass's parents) gives every node the same attention as
    planning that node alone over prefix + path."""
    from sglang_ext.attention import FrontierPaths, plan_frontier

    gen = torch.Generator().manual_seed(5)
    k_pool, v_pool = random_pools(200, HKV, D, gen)
    prefixes = [torch.arange(1, 40), torch.arange(60, 65)]
    paths = FrontierPaths.start(2, "cpu")
    paths = paths.advance(torch.tensor([100, 101, 150, 151]), None)  # pass 1: the roots' children
    paths = paths.advance(torch.tensor([102, 103, 152, 153]), torch.tensor([[1, 1], [0, 1]]))
    want = [[[101, 102], [101, 103]], [[150, 152], [151, 153]]]  # each node's path, root side first
    assert paths.slots.tolist() == [[100, 101, 102, 103], [150, 151, 152, 153]]
    for i in range(2):
        for j in range(2):
            assert paths.slots[i][paths.seen[i, j]].tolist() == want[i][j]
            assert paths.slots[i][paths.own()[i, j]].tolist() == want[i][j][-1:]
    plan = plan_frontier(prefixes, paths.slots, paths.seen)
    assert plan.batch_size == 2 and plan.num_queries == 4
    q = torch.randn(4, HQ, D, generator=gen)
    out = tree_attention_torch(q, k_pool, v_pool, plan, SCALE)
    row = 0
    for prefix, nodes in zip(prefixes, want):
        for node in nodes:
            slots = torch.cat([prefix, torch.tensor(node)])
            alone = tree_attention_torch(
                q[row : row + 1],
                k_pool,
                v_pool,
                plan_attention([slots], [torch.ones(1, slots.numel(), dtype=torch.bool)]),
                SCALE,
            )
            torch.testing.assert_close(out[row : row + 1], alone, atol=1e-5, rtol=1e-5)
            row += 1
    with pytest.raises(ValueError, match="frontier plan"):
        plan_frontier(prefixes[:1], paths.slots, paths.seen)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
    if sys.argv[1:] == ["triton-interpret"]:
        checks = {"parity": _run_parity_cases(), "static": _run_static_cases(), "tree_rows": _run_tree_rows_case()}
        print(json.dumps(checks))
    elif sys.argv[1:] == ["triton-parity"]:
        print(json.dumps(_run_parity_cases()))
    elif sys.argv[1:] == ["triton-static"]:
        print(json.dumps(_run_static_cases()))
    elif sys.argv[1:] == ["triton-tree-rows"]:
        print(json.dumps(_run_tree_rows_case()))
    elif sys.argv[1:] == ["triton-compile"]:
        sys.exit(_compile_for_sm80())
    else:
        modes = "triton-interpret | triton-parity | triton-static | triton-tree-rows | triton-compile"
        sys.exit(f"usage: {sys.argv[0]} {modes}")


def _random_requests(q_lens: list[int], k_extra: list[int], seed: int):
    """Per request its slots [K] and a random mask [Q, K] (K = Q + extra)."""
    gen = torch.Generator().manual_seed(seed)
    k_lens = [q + e for q, e in zip(q_lens, k_extra)]
    slots = [torch.randint(1, 500, (k,), generator=gen) for k in k_lens]
    masks = [torch.rand(q, k, generator=gen) < 0.6 for q, k in zip(q_lens, k_lens)]
    return slots, masks


@pytest.mark.parametrize("waste", [float("inf"), 1.5])  # one group of the batch; groups by kv length
def test_a_batch_wide_padded_group_equals_the_request_by_request_one(waste):
    """A group of few-query requests is gathered from the flat slots and mask in a fixed number of
    ops; it equals the group padded request by request (slots, mask, query rows)."""
    from sglang_ext.attention.plan import _buckets, _padded

    slots, masks = _random_requests([1, 3, 25, 2, 1, 6], [40, 0, 30, 90, 7, 61], seed=0)
    q_lens, k_lens = [m.shape[0] for m in masks], [m.shape[1] for m in masks]
    plan = plan_attention(slots, masks, waste)
    buckets = _buckets(q_lens, k_lens, waste)
    assert len(plan.groups) == len(buckets) and any(len(g) > 1 for g in buckets)
    for grp, idx in zip(plan.groups, buckets):
        ref = _padded(grp.q_index, grp.q_valid, grp.valid_at, [slots[i] for i in idx], [masks[i] for i in idx])
        for name in ("q_index", "q_valid", "kv_slots", "mask", "valid_at"):
            assert torch.equal(getattr(grp, name), getattr(ref, name)), name


def test_causal_masks_and_plan_flat_equal_the_per_request_masks_and_plan():
    """The batch's causal masks built flat (no tensor per request) and a plan over them equal each
    request's causal_mask and plan_attention over those."""
    from sglang_ext.attention import causal_masks, plan_flat

    q_lens, prefixes = [2, 1, 4, 3], [5, 0, 9, 40]
    for qs, ps in ((q_lens, prefixes), (q_lens[:1], prefixes[:1])):
        per_request = [causal_mask(q, p) for q, p in zip(qs, ps)]
        flat = causal_masks(qs, ps)
        assert torch.equal(flat, torch.cat([m.reshape(-1) for m in per_request]))
        slots = [torch.arange(100 * i, 100 * i + q + p) for i, (q, p) in enumerate(zip(qs, ps))]
        a, b = plan_attention(slots, per_request), plan_flat(slots, flat, qs)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", "q_lens", "k_lens"):
            assert torch.equal(torch.as_tensor(getattr(a, name)), torch.as_tensor(getattr(b, name))), name
        for ga, gb in zip(a.groups, b.groups, strict=True):
            for name in ("q_index", "q_valid", "kv_slots", "mask", "valid_at"):
                x, y = getattr(ga, name), getattr(gb, name)
                assert (x is None and y is None) or torch.equal(x, y), name
    with pytest.raises(ValueError):
        plan_flat(slots, flat[:-1], qs)
