"""The host-cost proxy (benchmarks/step_ops.py): ops a steady-state engine step dispatches outside graph
replays, on the meta device. A model drafter's whole search is one static function (one graph replay on
a GPU), so a drafted step dispatches a few hundred ops outside graphs, not the ~1,000-1,400 of a search
run step by step (EAGLE-3 and MoA at tree 6,4,24, one request)."""

import pytest

from benchmarks.step_ops import count_step_ops


@pytest.mark.parametrize("kind", ["eagle3", "moa"])
def test_a_drafted_steps_search_runs_inside_one_graph(kind):
    r = count_step_ops(kind, 1, "6,4,24", steps=2)
    s = r["per_step"]
    assert s["graph"] > 0 and s["outside"] < 500, r
    # nothing of the search's steps, paths or trees runs outside: no top-k, no path masks grown
    assert "topk" not in r["ops"] and "searchsorted" not in r["ops"], r["top_ops"]


def test_the_proxy_counts_a_vanilla_step():
    s = count_step_ops(None, 1, "6,4,24", steps=2)["per_step"]
    assert s["graph"] > 0 and 0 < s["outside"] < 150 and s["upload"] >= 1
