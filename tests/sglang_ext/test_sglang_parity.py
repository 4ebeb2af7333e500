"""Layout parity with SGLang 0.5.23's own Triton kernels, run on CPU under TRITON_INTERPRET=1.

Oracle: `sglang.kernels.ops.speculative.spec_tree` — `sgl_build_tree_kernel_triton` (FULL_MASK and
QLEN_ONLY) and `verify_tree_greedy_triton`, the kernels SGLang runs on XPU. Ours: `TreeSearch` ->
`build_trees` (+ `full_mask`) and `verify_tree_greedy` (tests/oracles.py, SGLang's signature over our layout; the
product's greedy_paths equals it: test_device_step.py).

    this process (pytest)                          subprocess: TRITON_INTERPRET=1 python this_file.py
    ---------------------                          --------------------------------------------------
    draft loop through TreeSearch (random probs)
    organize -> parent_list, top_scores_index  ->  inputs.pt  ->  SGLang kernels  ->  outputs.pt
    build_trees / full_mask / verify_tree_greedy                                          |
    compare field by field  <------------------------------------------------------------+

Why a subprocess: TRITON_INTERPRET must be set before triton is imported, and importing sglang costs
~10 s; doing either in the pytest process would change or slow every other test.

Why the import works on CPU without sgl_kernel: spec_tree imports `sgl_kernel` only when
`sglang.srt.utils.is_cpu()` is true, and that requires env SGLANG_USE_CPU_ENGINE=1 (plus an x86/arm
host). The subprocess drops that variable, so spec_tree takes no device branch at import and no shim
or patch is needed; `_is_cpu`/`_is_cuda` are checked to be False there.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from sglang_ext.tree import TokenTree, TreeSearch, build_trees, full_mask

REPO = Path(__file__).resolve().parents[2]
VOCAB = 48
MODES = {"full": 0, "qlen": 1}  # sglang TreeMaskMode.FULL_MASK, QLEN_ONLY

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")


@dataclass(frozen=True)
class Case:
    seed: int
    bs: int
    topk: int
    depth: int  # SGLang speculative_num_steps
    num_draft_tokens: int

    @property
    def id(self) -> str:
        return f"s{self.seed}-bs{self.bs}-k{self.topk}-d{self.depth}-n{self.num_draft_tokens}"


def _cases() -> list[Case]:
    corners = [
        (1, 1, 1, 2),
        (2, 1, 6, 7),
        (1, 2, 1, 3),
        (3, 8, 1, 9),
        (2, 8, 6, 64),
        (4, 4, 6, 64),
        (1, 4, 3, 37),
        (4, 2, 5, 17),
    ]
    cases = [Case(i, *c) for i, c in enumerate(corners)]
    rng = random.Random(2026)
    while len(cases) < 20:
        topk, depth = rng.choice([1, 2, 4, 8]), rng.randint(1, 6)
        most = depth + 1 if topk == 1 else min(64, 1 + topk + (depth - 1) * topk**2)
        n = most if topk == 1 else rng.randint(2, most)  # SGLang forces n = steps + 1 for topk = 1
        cases.append(Case(len(cases), rng.randint(1, 4), topk, depth, n))
    return cases


CASES = _cases()


# --- our side ----------------------------------------------------------------------------------------


def draft_search(case: Case, gen: torch.Generator) -> TreeSearch:
    """The draft loop of SGLang's EagleDraftWorker.draft_forward with random draft distributions.

    Step i selects the frontier from the previous forward's (topk_p, topk_index); every step but the
    last then runs the draft model on the bs*topk frontier tokens. With topk = 1 the CPU path of
    SGLang takes argmax and sets topk_p to ones.
    """
    k = case.topk
    search = TreeSearch.start(k)
    topk_p, topk_index = torch.softmax(3 * torch.randn(case.bs, VOCAB, generator=gen), -1).topk(k, dim=-1)
    scores = None
    for i in range(case.depth):
        if i == 0:
            _, scores = search.first(topk_p, topk_index)
        else:
            _, scores, _ = search.expand(i, scores, topk_p, topk_index)
        if i == case.depth - 1:
            break
        probs = torch.softmax(3 * torch.randn(case.bs * k, VOCAB, generator=gen), -1)
        topk_p, topk_index = probs.topk(k, dim=-1)
        if k == 1:
            topk_p = torch.ones_like(topk_p)
    return search


def agreeing_target_predict(trees: list[TokenTree], gen: torch.Generator) -> torch.Tensor:
    """[bs, N] target argmax per node: usually the token of one of the node's children, so long paths get accepted."""
    rows = []
    for tree in trees:
        row = []
        for node in range(tree.num_nodes):
            children, c = [], int(tree.retrieve_next_token[node])
            while c != -1:
                children.append(c)
                c = int(tree.retrieve_next_sibling[c])
            if children and float(torch.rand((), generator=gen)) < 0.9:
                pick = children[int(torch.randint(len(children), (), generator=gen))]
                row.append(int(tree.draft_tokens[pick]))
            else:
                row.append(int(torch.randint(VOCAB, (), generator=gen)))
        rows.append(row)
    return torch.tensor(rows)


def stack(trees: list[TokenTree], field: str) -> torch.Tensor:
    return torch.stack([getattr(t, field) for t in trees])


def make_inputs(case: Case) -> tuple[dict, dict]:
    """(what SGLang's kernels get, what ours produce) for one case."""
    from oracles import verify_tree_greedy  # (this process: the subprocess has tests/ on its path only later)

    gen = torch.Generator().manual_seed(case.seed)
    search = draft_search(case, gen)
    parent_list, top_scores_index, draft = search.organize(case.num_draft_tokens)
    seq_lens = torch.randint(1, 40, (case.bs,), generator=gen)
    roots = torch.randint(VOCAB, (case.bs,), generator=gen)
    trees = build_trees(roots, search, seq_lens.tolist(), case.num_draft_tokens)
    target_predict = agreeing_target_predict(trees, gen)
    num_spec = [case.depth + 1, case.num_draft_tokens]  # SGLang's max_tree_depth, and the whole tree

    ours = {
        "full": full_mask(trees, seq_lens.tolist()),
        "qlen": torch.cat([t.tree_mask.flatten() for t in trees]),
        "positions": torch.cat([t.positions for t in trees]),
        "draft_tokens": torch.cat([t.draft_tokens for t in trees]),
        **{f: stack(trees, f) for f in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling")},
    }
    candidates = stack(trees, "draft_tokens")
    for s in num_spec:
        ours[f"verify{s}"] = verify_tree_greedy(
            candidates,
            ours["retrieve_index"],
            ours["retrieve_next_token"],
            ours["retrieve_next_sibling"],
            target_predict,
            s,
        )
    sglang_in = {
        "case": asdict(case),
        "parent_list": parent_list,
        "top_scores_index": top_scores_index,
        "draft": draft,
        "roots": roots,
        "seq_lens": seq_lens,
        # verification is checked on our tree (same as SGLang's whenever the build parity holds)
        "candidates": candidates,
        "target_predict": target_predict,
        "num_spec": num_spec,
        **{f: ours[f] for f in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling")},
    }
    return sglang_in, ours


# --- SGLang side (runs in the subprocess) --------------------------------------------------------------


def run_sglang(inputs: list[dict]) -> list[dict]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "triton would try to compile for a GPU"
    from sglang.kernels.ops.speculative import spec_tree

    assert not (spec_tree._is_cpu or spec_tree._is_cuda), "spec_tree took a device branch at import"
    return [_sglang_case(spec_tree, x) for x in inputs]


def _sglang_case(spec_tree, x: dict) -> dict:
    c = Case(**x["case"])
    bs, n, seq_lens = c.bs, c.num_draft_tokens, x["seq_lens"]
    out = {}
    for mode_name, mode in MODES.items():
        # buffers allocated as eagle_utils.build_tree_kernel_efficient does
        size = int(seq_lens.sum()) * n + n * n * bs if mode == 0 else n * n * bs
        tree_mask = torch.full((size,), True, dtype=torch.bool)
        retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
        positions = torch.empty((bs * n,), dtype=torch.long)
        spec_tree.sgl_build_tree_kernel_triton(
            x["parent_list"],
            x["top_scores_index"],
            seq_lens,
            tree_mask,
            positions,
            *retrieve,
            c.topk,
            c.depth,
            n,
            spec_tree.TreeMaskMode(mode),
        )
        out[mode_name] = tree_mask
        out[f"{mode_name}/positions"] = positions
        for f, t in zip(("retrieve_index", "retrieve_next_token", "retrieve_next_sibling"), retrieve):
            out[f"{mode_name}/{f}"] = t
    # build_tree_kernel_efficient's python side: bonus (root) token first, flattened
    out["draft_tokens"] = torch.cat((x["roots"].unsqueeze(1), x["draft"]), dim=1).flatten()

    for s in x["num_spec"]:
        # allocated as eagle_utils.eagle_sample does (accept_token_num: empty there; every entry is written)
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, s), -1, dtype=torch.int32)
        accept_num = torch.full((bs,), -7, dtype=torch.int32)
        spec_tree.verify_tree_greedy_triton(
            predicts,
            accept_index,
            accept_num,
            x["candidates"],
            x["retrieve_index"],
            x["retrieve_next_token"],
            x["retrieve_next_sibling"],
            x["target_predict"],
        )
        out[f"verify{s}"] = (predicts, accept_index, accept_num)
    return out


def sglang_subprocess(inputs: list[dict], workdir: Path) -> list[dict]:
    in_path, out_path = workdir / "inputs.pt", workdir / "outputs.pt"
    torch.save(inputs, in_path)
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET")}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(in_path), str(out_path)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out_path)


# --- tests ---------------------------------------------------------------------------------------------


def orphan_case_inputs() -> tuple[dict, dict]:
    """A tie that leaves a selected node's parent unselected (see test_orphan_node_layout_matches_sglang)."""
    case = Case(seed=-1, bs=1, topk=2, depth=2, num_draft_tokens=4)
    search = TreeSearch.start(2)
    _, scores = search.first(torch.tensor([[0.6, 0.3]]), torch.tensor([[10, 11]]))
    # beam 1 is certain of its child (p = 1.0): that child ties its parent's score 0.3
    search.expand(1, scores, torch.tensor([[0.5, 0.1], [1.0, 0.0]]), torch.tensor([[20, 21], [30, 31]]))
    parent_list, top, draft = search.organize(case.num_draft_tokens)
    trees = build_trees(torch.tensor([1]), search, [5], case.num_draft_tokens)
    fields = ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling")
    ours = {
        "qlen": trees[0].tree_mask.flatten(),
        "positions": trees[0].positions,
        **{f: stack(trees, f) for f in fields},
    }
    empty = torch.empty(1, 0, dtype=torch.long)
    sglang_in = {
        "case": asdict(case),
        "parent_list": parent_list,
        "top_scores_index": top,
        "draft": draft,
        "roots": torch.tensor([1]),
        "seq_lens": torch.tensor([5]),
        "num_spec": [],
        "candidates": empty,
        "target_predict": empty,
        **{f: ours[f] for f in fields},
    }
    return sglang_in, ours


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    made = {c.id: make_inputs(c) for c in CASES}
    made["orphan"] = orphan_case_inputs()
    keys = list(made)
    theirs = sglang_subprocess([made[k][0] for k in keys], tmp_path_factory.mktemp("sglang"))
    return {k: (made[k][1], t) for k, t in zip(keys, theirs)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_build_tree_matches_sglang(parity, case, mode):
    ours, theirs = parity[case.id]
    assert torch.equal(ours[mode], theirs[mode]), "tree_mask"
    assert torch.equal(ours["positions"], theirs[f"{mode}/positions"]), "positions"
    for f in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        assert torch.equal(ours[f], theirs[f"{mode}/{f}"]), f
    assert torch.equal(ours["draft_tokens"], theirs["draft_tokens"]), "draft_tokens"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_verify_greedy_matches_sglang(parity, case):
    ours, theirs = parity[case.id]
    for s in (case.depth + 1, case.num_draft_tokens):
        for name, a, b in zip(
            ("predicts", "accept_index", "accept_token_num"), ours[f"verify{s}"], theirs[f"verify{s}"]
        ):
            assert torch.equal(a.long(), b.long()), f"{name} (num_speculative_tokens={s})"


def test_cases_accept_long_paths(parity):
    """The random target_predict must exercise deep accepts, or the verify parity says little."""
    longest = max(int(parity[c.id][0][f"verify{c.depth + 1}"][2].max()) for c in CASES)
    assert longest >= 5


def test_orphan_node_mask_and_positions_match_sglang(parity):
    """Scores tie (a child with p = 1.0) and topk keeps the child but not its parent: the orphan sees
    the root and itself, at position seq_len + 1, in both implementations."""
    ours, theirs = parity["orphan"]
    assert torch.equal(ours["qlen"], theirs["qlen"])
    assert torch.equal(ours["positions"], theirs["qlen/positions"])


def test_orphan_node_retrieval_matches_sglang(parity):
    """SGLang's kernel leaves the orphan out of retrieve_next_token/sibling, so verification can never
    reach it; so do we."""
    ours, theirs = parity["orphan"]
    for f in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        assert torch.equal(ours[f], theirs[f"qlen/{f}"]), f


if __name__ == "__main__":  # the SGLang side: python tests/sglang_ext/test_sglang_parity.py INPUTS OUTPUTS
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
    torch.save(run_sglang(torch.load(sys.argv[1])), sys.argv[2])
