"""The host-cost proxy (moa_serve/benchmarks/step_ops.py): ops a steady-state engine step dispatches outside graph
replays, on the meta device. A model drafter's whole search is one static function (one graph replay on
a GPU), and so are its draft-extend (EAGLE-3: with the search, one graph) or commit (MoA's LSA, CA and SA
K/V) of the verified tokens, their prefixes read from slot tables on the device: a drafted step dispatches
under 100 ops outside graphs, not the ~1,000-1,400 of a search run step by step nor the ~300 of an eager
extend or commit (EAGLE-3 and MoA at tree 6,4,24), MoA's commit running first in its search's graph. The verify takes
the search's packed trees whole (two device copies into its graph's buffers). The engine's own per-request work (root
trees, KV slots, graph inputs, compaction, the drafter's captures) is batch-wide: a plain decode step costs the same
ops at any batch, and a drafted one the same at bs 1, 16 and 64."""

import pytest

from moa_serve.benchmarks.step_ops import count_step_ops

# A drafted step at bs 1 (tree 6,4,24, 4 layers): EAGLE-3 58, MoA 56 (2026-11-29)
DRAFTED_OUTSIDE = 60


@pytest.mark.parametrize("kind", ["eagle3", "moa"])
def test_a_drafted_steps_search_and_extend_run_inside_graphs(kind):
    r = count_step_ops(kind, 1, "6,4,24", steps=2)
    s = r["per_step"]
    assert s["graph"] > 0 and s["outside"] <= DRAFTED_OUTSIDE, r
    # nothing of the search's steps, paths or trees runs outside: no top-k, no path masks grown
    assert "topk" not in r["ops"] and "searchsorted" not in r["ops"], r["top_ops"]
    # nor of the draft-extend (EAGLE-3) or the commit (MoA's LSA, CA and SA K/V): no matmul, no RoPE, no softmax
    assert not {"linear", "mm", "addmm", "bmm", "mul", "_softmax"} & set(r["ops"]), r["top_ops"]
    # the trees go into the verify's buffers whole: no per-field placing, stacking or gathering of rows
    assert not {"stack", "index_put_", "fill_"} & set(r["ops"]), r["top_ops"]


# A plain greedy decode step outside its graph replay (12 at any batch): the new slots (2 host ops), the
# upload's host packing (4) and its copy (2), the tokens' view and copy, the slots appended (3). Its prefixes
# come from the slot table on the device, its logits and argmax from the graph.
VANILLA_OUTSIDE = 12


def test_the_proxy_counts_a_vanilla_step():
    r = count_step_ops(None, 1, "6,4,24", steps=2)
    s = r["per_step"]
    assert s["graph"] > 0 and 0 < s["outside"] <= VANILLA_OUTSIDE and s["upload"] >= 1, r["sites"]
    assert "argmax" not in r["ops"] and "argmax" in r["kernel_ops"], r["ops"]


@pytest.mark.parametrize("batch", [16, 64])
def test_a_plain_decode_step_costs_the_same_ops_at_any_batch(batch):
    """16 or 64 requests (prefilled in one step: the measured steps are plain decode) cost what one does: no
    op per request outside the graph."""
    r = count_step_ops(None, batch, "6,4,24", steps=1, where=True)
    assert r["per_step"]["graph"] > 0 and r["per_step"]["outside"] <= VANILLA_OUTSIDE, r["sites"]


# A drafted step at bs 16 (tree 6,4,24, 2 layers; EAGLE-3 58, MoA 56 on 2026-11-29): the total leaves no room for one
# more op per request (16), and per site the drafters' graph inputs (the draft-extend's or commit's upload, the
# search's, the slot tables' pairs), their outputs and the drafters' own bookkeeping (slot lists grown in one cat
# for the batch) cost ops per step, not per request: every site of theirs stays under OWN_SITE. A per-request op
# back in any of them adds 16 to its site's count.
OWN = ("plan.py:", "draft_graphs.py:", "slot_table.py:", "eagle3.py:", "moa.py:")
OWN_SITE = 12
BS16 = {"eagle3": 60, "moa": 60}


@pytest.mark.parametrize("kind", ["eagle3", "moa"])
def test_a_drafted_steps_graph_inputs_and_bookkeeping_cost_ops_per_step_not_per_request(kind):
    r = count_step_ops(kind, 16, "6,4,24", layers=2, steps=1, where=True)
    assert r["per_step"]["outside"] <= BS16[kind], r["sites"]
    # greedy verification (the logits, their argmax, the paths) runs inside the verify's graph
    assert not any(s.startswith(("verify.py:_greedy_nodes", "sampling.py:greedy_tokens")) for s in r["sites"]), r
    own = {s: c for s, c in r["sites"].items() if s.startswith(OWN)}
    assert not {s: c for s, c in own.items() if c > OWN_SITE}, own
    # the draft-extend's, the commit's and the search's RoPE and attention plans: in their graphs
    assert not any(s.startswith(("llama.py:apply_rope", "plan.py:")) for s in r["sites"]), r["sites"]


def test_the_proxy_counts_a_steps_launches_inside_its_graphs():
    """The kernels a vanilla step's graph launches on a GPU: every decoder layer's Triton kernels and GEMMs
    (the count grows with the layers), no view or allocation among them."""
    from moa_serve.benchmarks.step_ops import kernels_per_layer

    r = count_step_ops(None, 1, "6,4,24", layers=2, steps=1)
    ops = r["kernel_ops"]
    assert r["per_step"]["kernels"] == sum(ops.values()) and 0 < r["per_step"]["kernels"] < r["per_step"]["graph"]
    assert ops.get("_row_attention_kernel") == 2 and not {"empty", "view", "empty_like"} & set(ops), ops
    # the fused layer: norm + qkv + RoPE + K/V store, attention, o + residual, norm + gate-up + SiLU, down + residual
    assert kernels_per_layer(None, 1, layers=2) <= 6


def test_a_drafted_step_at_bs_64_with_a_24_node_tree_verifies_inside_a_graph():
    """64 requests x a 25-node tree (1,600 rows: a search's packed trees are verified without node padding) fit the
    target's graph buckets: the verify forward's kernels are in a replay, none of them outside."""
    r = count_step_ops("eagle3", 64, "6,4,24", layers=2, steps=1)
    assert "_fused_linear_kernel" not in r["ops"] and "_row_attention_kernel" not in r["ops"], r["top_ops"]
    assert r["kernel_ops"].get("_fused_linear_kernel", 0) >= 2 * 4, r["kernel_ops"]
    assert r["per_step"]["outside"] <= BS16["eagle3"], r["top_ops"]  # (what a step at bs 16 costs: none per request)
