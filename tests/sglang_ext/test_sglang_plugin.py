"""The SGLang plugin (sglang_ext/sglang_plugin, docs/SGLANG.md) against the real sglang==0.5.23.

    this process (pytest, no sglang import)           subprocess: TRITON_INTERPRET=1 python this_file.py OUT
    ------------------------------------------        ------------------------------------------------------
    packbits / FlashInfer planning / ragged plans     load_plugins(), from_string("MOA"), ServerArgs resolution
    layout index functions                             (accepted + rejected), factory -> worker class,
    draft_core == embedded MoADrafter (trees)          draft ModelConfig, MoADraftModel built from SGLang layers
                                                       (single-process gloo group): every weight consumed, pieces
                                                       == MoADraft, moa_draft trees equal; EAGLE-3 head into
                                                       LlamaForCausalLMEagle3; Triton tree attention == torch;
                                                       our mask packing == SGLang's pack_verify_mask kernel
                                                       -> results.pt  <- read by the module fixture

Why one subprocess: sglang imports cost ~20 s on this machine and TRITON_INTERPRET must be set
before triton is imported. It runs with cwd outside the repo so the package is found through its
installed entry point (the repo root holds a stale, git-ignored moa_serve.egg-info that would
shadow it). GPU-only tests at the end are marked `gpu` and skip here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_ext.attention import plan_attention, prefix_and_tree_mask, tree_attention_torch
from sglang_ext.attention.flashinfer_plan import (
    flashinfer_plan,
    packbits_little,
    paged_attention_reference,
    plan_from_ragged,
    segment_packbits_little,
    segment_unpackbits_little,
    unpackbits_little,
)

REPO = Path(__file__).resolve().parents[2]
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


# --- shared fixtures (used by both processes) ---------------------------------------------------------


def random_trees(seed: int, bs: int, n_nodes: list[int], prefix: list[int]):
    """Per request: a random tree (parents before children), its prefix length, mask [N, P+N]."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for b in range(bs):
        n = n_nodes[b]
        tm = torch.zeros(n, n, dtype=torch.bool)
        tm[0, 0] = True
        for i in range(1, n):
            p = int(torch.randint(i, (), generator=g))
            tm[i] = tm[p]
            tm[i, i] = True
        masks.append(prefix_and_tree_mask(tm, prefix[b]))
    return masks


def tiny_moa_checkpoint(out_dir: Path, tli: int = 1, draft_vocab: int = 40, sa_mode: str = "self", seed: int = 0):
    """A random MoA checkpoint for a tiny target (tests/helpers.tiny_config with vocab 64) + target config dir."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import tiny_config

    from sglang_ext.models.moa import MoAConfig, MoADraft

    t = tiny_config(vocab=64, hidden=32, layers=3)
    cfg = MoAConfig.for_target(t, tli=tli, draft_vocab_size=draft_vocab, sa_tree_attention=sa_mode)
    torch.manual_seed(seed)
    draft = MoADraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    if draft_vocab:
        draft.set_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:draft_vocab])
    draft.save(out_dir / "moa", dtype=torch.float32)
    target = out_dir / "target"
    target.mkdir(parents=True, exist_ok=True)
    hf = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    (target / "config.json").write_text(json.dumps(hf))
    return out_dir / "moa", target, t


def tiny_target_model(seed: int = 1):
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import tiny_target

    return tiny_target(seed=seed, vocab=64, hidden=32, layers=3).model


def draft_parity_case(draft, tm, tli: int, sa_mode: str, steps: int, topk: int, n: int):
    """Trees from the embedded MoADrafter and from draft_core.moa_draft (with `draft` as the draft
    model) for two requests; returns [(embedded tokens, embedded parents, ours tokens, ours parents)]."""
    from sglang_ext.attention import causal_mask
    from sglang_ext.drafters.base import DraftInput, TargetCapture
    from sglang_ext.drafters.moa import MoADrafter
    from sglang_ext.drafters.moa_core import MEMORY_TOKENS
    from sglang_ext.models.llama import rms_norm
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.sglang_plugin.draft_core import MoAPools, moa_commit, moa_draft
    from sglang_ext.sglang_plugin.layout import draft_columns
    from sglang_ext.tree import TreeShape, node_parents, tree_from_parents

    g = torch.Generator().manual_seed(11)
    reference = draft.reference if hasattr(draft, "reference") else draft
    emb = MoADrafter(tm, reference, num_slots=512)
    kv = tm.new_kv_pool(512)
    # (prompts of at most MEMORY_TOKENS: the embedded drafter gives a prompt's last MEMORY_TOKENS tokens memory, the
    # plugin's commit every token, its CA reading a request's slots whole)
    prompts = [torch.randint(64, (n,), generator=g).tolist() for n in (7, MEMORY_TOKENS)]
    roots = [5, 9]
    slots = []
    for rid, p in enumerate(prompts):
        s = kv.alloc(len(p))
        slots.append(s)
        tm.forward(torch.tensor(p), torch.arange(len(p)), s, plan_attention([s], [causal_mask(len(p), 0)]), kv)
        emb.add_request(rid, TargetCapture(token_ids=p, positions=torch.arange(len(p)), slots=s, kv=kv))
    trees = emb.propose(
        [DraftInput(rid, prompts[rid] + [roots[rid]], SamplingParams(), None) for rid in range(2)],
        TreeShape(steps, topk, n),
    )

    cfg = reference.cfg
    num_slots = kv.k[0].shape[0]
    pools = MoAPools(*(torch.zeros(num_slots, cfg.num_kv_heads, cfg.head_dim) for _ in range(4)), kv.k, kv.v)
    width = draft_columns(steps, topk)
    req_to_token = torch.zeros(2, 64, dtype=torch.long)
    for b, p in enumerate(prompts):
        req_to_token[b, : len(p)] = slots[b]
        req_to_token[b, len(p) : len(p) + width] = kv.alloc(width)
        moa_commit(draft, tm.embed, pools, slots[b], torch.arange(len(p)), torch.tensor(p))

    def layer(li):
        def forward(x, pos, s, plan):
            return tm.layer_forward(li, x, tm.rope(pos), s, plan, kv)

        return forward

    layers = [layer(li) for li in range(3 - tli, 3)]
    hot = reference.hot_ids
    parent_list, top, tokens = moa_draft(
        draft,
        tm.embed,
        tm.lm_head[hot],
        hot,
        lambda x: rms_norm(x, tm.norm, tm.cfg.rms_norm_eps),
        layers,
        pools,
        tree_attention_torch,
        req_to_token,
        torch.arange(2),
        torch.tensor([len(p) for p in prompts]),
        torch.tensor(roots),
        topk,
        steps,
        n,
        sa_mode,
    )
    out = []
    for b in range(2):
        par, orphans = node_parents(parent_list[b], top[b], topk)
        ours = tree_from_parents(
            torch.cat([torch.tensor([roots[b]]), tokens[b]]), par, len(prompts[b]), b, unlinked=orphans
        )
        out.append(
            (
                trees[b].draft_tokens.tolist(),
                trees[b].parents.tolist(),
                ours.draft_tokens.tolist(),
                ours.parents.tolist(),
            )
        )
    return out


# --- CPU tests in this process ------------------------------------------------------------------------


def test_packbits_little_matches_numpy_and_round_trips():
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 64, 333):
        bits = torch.rand(n, generator=g) < 0.5
        packed = packbits_little(bits)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
        assert np.array_equal(packed.numpy(), np.packbits(bits.numpy(), bitorder="little"))
        assert torch.equal(unpackbits_little(packed, n), bits)


def test_segment_packbits_pads_each_request_to_whole_bytes():
    bits = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    packed, indptr = segment_packbits_little(bits, torch.tensor([0, 4, 7, 11]))
    assert indptr.tolist() == [0, 1, 2, 3]
    assert packed.tolist() == [0b1101, 0b100, 0b1011]  # little-endian: element i -> bit i
    assert torch.equal(segment_unpackbits_little(packed, indptr, [4, 3, 4]), bits)


@pytest.mark.parametrize("seed", range(4))
def test_flashinfer_plan_reproduces_tree_attention_torch(seed):
    """qo_indptr / kv_indptr / kv_indices / kv_last_page_len / packed mask + mask_indptr, consumed by
    a reference that reads exactly those arrays, give tree_attention_torch's output."""
    g = torch.Generator().manual_seed(seed)
    bs = 1 + seed % 3
    n_nodes = [int(torch.randint(1, 12, (), generator=g)) for _ in range(bs)]
    prefix = [int(torch.randint(0, 40, (), generator=g)) for _ in range(bs)]
    masks = random_trees(seed, bs, n_nodes, prefix)
    num_slots, hq, hkv, d = 200, 4, 2, 16
    perm = torch.randperm(num_slots - 1, generator=g) + 1
    slots, used = [], 0
    for m in masks:
        slots.append(perm[used : used + m.shape[1]])
        used += m.shape[1]
    plan = plan_attention(slots, masks)
    q = torch.randn(plan.num_queries, hq, d, generator=g)
    k_pool, v_pool = torch.randn(num_slots, hkv, d, generator=g), torch.randn(num_slots, hkv, d, generator=g)
    fi = flashinfer_plan(plan)
    assert fi.kv_last_page_len.tolist() == [1] * bs
    assert fi.mask_indptr.tolist() == [0] + np.cumsum([(m.numel() + 7) // 8 for m in masks]).tolist()
    assert torch.equal(
        segment_unpackbits_little(fi.packed_mask, fi.mask_indptr, [m.numel() for m in masks]), plan.custom_mask
    )
    ref = tree_attention_torch(q, k_pool, v_pool, plan, d**-0.5)
    got = paged_attention_reference(q, k_pool, v_pool, fi, d**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the ragged arrays alone rebuild an equivalent plan (what the MoA worker builds on the GPU)
    again = plan_from_ragged(fi.qo_indptr, fi.kv_indptr, fi.kv_indices, fi.custom_mask)
    torch.testing.assert_close(tree_attention_torch(q, k_pool, v_pool, again, d**-0.5), ref, rtol=1e-5, atol=1e-5)


class _StandInWrapper:
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper's plan/run on CPU: run() attends over exactly the
    arrays plan() was given (through plan_from_ragged), and every instance counts its plans."""

    plans = 0

    def __init__(self, workspace, layout):
        assert layout == "NHD"
        self.workspace = workspace

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size, **kw):
        assert page_size == 1 and last_page_len.tolist() == [1] * (qo_indptr.numel() - 1) and not kw["causal"]
        type(self).plans += 1
        self.ragged, self.scale = plan_from_ragged(qo_indptr, kv_indptr, kv_indices, kw["custom_mask"]), kw["sm_scale"]

    def run(self, q, kv):
        k_pool, v_pool = (t.squeeze(1) for t in kv)
        return tree_attention_torch(q, k_pool, v_pool, self.ragged, self.scale)


def test_flashinfer_backend_plans_once_per_step_and_holds_its_own_state(monkeypatch):
    """Every layer of a step reuses the step planned for its plan object; a new plan (or head layout)
    plans again; two backends (two workers) share nothing. Results equal tree_attention_torch."""
    from sglang_ext.attention.flashinfer_plan import FlashInferTreeAttention
    from sglang_ext.sglang_plugin.tree_attention import select_tree_attention

    monkeypatch.setattr(_StandInWrapper, "plans", 0)
    monkeypatch.setitem(
        sys.modules, "flashinfer", types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_StandInWrapper)
    )
    g = torch.Generator().manual_seed(0)
    masks = random_trees(3, 2, [5, 7], [9, 4])
    slots = [torch.randperm(60, generator=g)[: m.shape[1]] for m in masks]
    step1, step2 = plan_attention(slots, masks), plan_attention(slots, masks)
    k_pool, v_pool = torch.randn(60, 2, 16, generator=g), torch.randn(60, 2, 16, generator=g)
    attention = FlashInferTreeAttention(workspace_bytes=16)
    for plan, plans_after in ((step1, 1), (step2, 2)):
        for _layer in range(3):
            q = torch.randn(plan.num_queries, 4, 16, generator=g)
            ref = tree_attention_torch(q, k_pool, v_pool, plan, 0.25)
            torch.testing.assert_close(attention(q, k_pool, v_pool, plan, 0.25), ref, rtol=1e-5, atol=1e-5)
        assert _StandInWrapper.plans == plans_after
    attention(torch.randn(step2.num_queries, 2, 16), k_pool, v_pool, step2, 0.25)  # 2 query heads: a new layout
    assert _StandInWrapper.plans == 3
    other = select_tree_attention("cpu", "flashinfer")
    assert isinstance(other, FlashInferTreeAttention) and other.step is None and other is not attention
    other(torch.randn(step2.num_queries, 4, 16), k_pool, v_pool, step2, 0.25)
    assert _StandInWrapper.plans == 4 and attention.step.plan is step2 and other.workspace is not attention.workspace


def test_committed_after_verify_matches_a_loop():
    from sglang_ext.sglang_plugin.layout import committed_after_verify

    g = torch.Generator().manual_seed(3)
    bs, n, width = 3, 6, 4
    out_cache_loc = torch.randperm(100, generator=g)[: bs * n]
    draft_token = torch.randint(50, (bs * n,), generator=g)
    accept_lens = torch.tensor([1, 4, 2])
    accept_index = torch.full((bs, width), -1)
    for b in range(bs):
        nodes = [0] + sorted(torch.randperm(n - 1, generator=g)[: int(accept_lens[b]) - 1].add(1).tolist())
        accept_index[b, : len(nodes)] = torch.tensor(nodes) + b * n
    seq_lens = torch.tensor([10, 3, 7])
    slots, pos, tok, bidx = committed_after_verify(out_cache_loc, accept_index, accept_lens, seq_lens, draft_token, n)
    want = [
        (int(out_cache_loc[b * n + j]), int(seq_lens[b]) + j, int(draft_token[accept_index[b, j]]), b)
        for b in range(bs)
        for j in range(int(accept_lens[b]))
    ]
    assert list(zip(slots.tolist(), pos.tolist(), tok.tolist(), bidx.tolist())) == want


def test_committed_after_extend_positions_follow_prefix():
    from sglang_ext.sglang_plugin.layout import committed_after_extend

    slots, pos, tok = committed_after_extend(
        torch.arange(7) + 100, torch.arange(7) + 50, prefix_lens=[0, 5], extend_lens=[3, 4]
    )
    assert pos.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert slots.tolist() == list(range(100, 107)) and tok.tolist() == list(range(50, 57))


def test_tree_step_plan_matches_per_node_plans():
    """The worker's batched plan (per request: prefix + draft block, mask = visible columns) gives the
    same attention as one plan row per node listing its slots (what the embedded drafter builds)."""
    from sglang_ext.sglang_plugin.layout import (
        draft_block,
        draft_columns,
        next_visibility,
        step_columns,
        tree_step_plan,
    )

    g = torch.Generator().manual_seed(5)
    bs, topk, steps = 3, 2, 4
    seq_lens = torch.tensor([4, 9, 1])
    width = draft_columns(steps, topk)
    req_to_token = torch.zeros(5, 32, dtype=torch.long)
    perm = torch.randperm(200, generator=g) + 1
    for b in range(bs):
        req_to_token[b + 1, : int(seq_lens[b]) + width] = perm[b * 30 : b * 30 + int(seq_lens[b]) + width]
    rpi = torch.tensor([1, 2, 3])
    block = draft_block(req_to_token, rpi, seq_lens, width)
    visible = next_visibility(None, None, step_columns(0, topk), width, bs)
    visible = next_visibility(visible, None, step_columns(1, topk), width, bs)
    parent = torch.tensor([[1, 0], [0, 0], [1, 1]])
    visible = next_visibility(visible, parent, step_columns(2, topk), width, bs)
    used = int(step_columns(2, topk).max()) + 1
    plan = tree_step_plan(req_to_token, rpi, seq_lens, block[:, :used], visible[:, :, :used], topk)
    # per node: its prefix slots + its visible block slots, one query each
    lists = []
    for b in range(bs):
        for j in range(topk):
            cols = visible[b, j, :used].nonzero().flatten()
            lists.append(torch.cat([req_to_token[rpi[b], : seq_lens[b]], block[b, cols]]))
    per_node = plan_attention(lists, [torch.ones(1, s.numel(), dtype=torch.bool) for s in lists])
    q = torch.randn(bs * topk, 4, 8, generator=g)
    kp, vp = torch.randn(201, 2, 8, generator=g), torch.randn(201, 2, 8, generator=g)
    torch.testing.assert_close(
        tree_attention_torch(q, kp, vp, plan, 0.3), tree_attention_torch(q, kp, vp, per_node, 0.3), rtol=1e-5, atol=1e-5
    )
    # step-2 node 0 of request 0 descends from step-1 node 1: it sees root, that node and itself
    assert visible[0, 0, :used].nonzero().flatten().tolist() == [0, 2, 3]


@pytest.mark.parametrize(
    "tli,sa_mode,shape", [(1, "self", (4, 3, 10)), (0, "ancestors", (3, 2, 6)), (2, "ancestors", (5, 1, 6))]
)
def test_draft_core_trees_equal_embedded_moa_drafter(tmp_path, tli, sa_mode, shape):
    """The SGLang worker's draft math (slot-indexed pools, batched tree plans, TLI through the
    target's layers) drafts exactly the embedded MoA drafter's trees."""
    from sglang_ext.models.moa import load_moa

    ckpt, _, _ = tiny_moa_checkpoint(tmp_path, tli=tli, sa_mode=sa_mode)
    draft = load_moa(ckpt)
    for emb_tokens, emb_parents, our_tokens, our_parents in draft_parity_case(
        draft, tiny_target_model(), tli, sa_mode, *shape
    ):
        assert our_tokens == emb_tokens
        assert our_parents == emb_parents


# --- SGLang subprocess ----------------------------------------------------------------------------------


def _check(results: dict, name: str, fn) -> None:
    try:
        results[name] = {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - every check reports, the test asserts
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}


def _init_single_process_group() -> None:
    """world = 1 gloo group + SGLang's model-parallel groups (its layers need them even at tp 1), on a free port (two
    suites on one machine must not meet)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        os.environ.setdefault(k, v)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=1, pp_size=1, device="cpu"), role="test", ranks=SpawnRanks(world_rank=0)
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def run_sglang_checks(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results: dict = {}
    work = Path(out_path).parent / "work"  # inside pytest's tmp dir
    work.mkdir(parents=True, exist_ok=True)
    ckpt, target_dir, _ = tiny_moa_checkpoint(work)
    eagle3 = REPO / "drafters" / "smollm2-eagle3"

    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins

    load_plugins()

    def discovered():
        eps = [(e.name, e.value) for e in entry_points(group="sglang.srt.plugins")]
        from sglang.srt.models.registry import ModelRegistry
        from sglang.srt.speculative.spec_registry import get_spec
        from transformers import AutoConfig

        return {
            "entry_points": eps,
            "registered": get_spec("MOA") is not None,
            "model_registered": "MoADraftModel" in ModelRegistry.models,
            "autoconfig": type(AutoConfig.from_pretrained(str(ckpt))).__name__,
        }

    _check(results, "discovered", discovered)

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    def from_string():
        algo = SpeculativeAlgorithm.from_string("MOA")
        enum_methods = {
            n
            for n, v in vars(SpeculativeAlgorithm).items()
            if callable(v) and not n.startswith("_") and n not in ("from_string", "register")
        }
        missing = sorted(n for n in enum_methods if not callable(getattr(algo, n, None)))
        return {
            "type": type(algo).__name__,
            "name": algo.name,
            "is_eagle": algo.is_eagle(),
            "is_eagle3": algo.is_eagle3(),
            "need_topk": algo.need_topk(),
            "carries_hidden": algo.carries_draft_hidden_states(),
            "missing": missing,
            "lower": type(SpeculativeAlgorithm.from_string("moa")).__name__,
        }

    _check(results, "from_string", from_string)

    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_ext.settings import settings

    base = ["--model-path", str(target_dir), "--device", "cpu", "--speculative-algorithm", "MOA"]

    def resolve(extra, env=None):
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        settings.cache_clear()  # settings() reads the environment once
        try:
            sa = prepare_server_args(base + extra)
            sa.resolve_once()
            return sa
        finally:
            for k, v in old.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            settings.cache_clear()

    fields = (
        "speculative_algorithm",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "disable_overlap_schedule",
        "page_size",
        "max_running_requests",
    )
    accepted = {
        "defaults": ["--speculative-draft-model-path", str(ckpt)],
        "chain": [
            "--speculative-draft-model-path",
            str(ckpt),
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ],
        "tree": [
            "--speculative-draft-model-path",
            str(ckpt),
            "--speculative-num-steps",
            "6",
            "--speculative-eagle-topk",
            "8",
            "--speculative-num-draft-tokens",
            "48",
        ],
        "chain_implicit_tokens": [
            "--speculative-draft-model-path",
            str(ckpt),
            "--speculative-num-steps",
            "2",
            "--speculative-eagle-topk",
            "1",
        ],
    }
    for name, extra in accepted.items():
        _check(
            results,
            f"accept/{name}",
            lambda extra=extra: {f: getattr(resolved_view(resolve(extra)), f) for f in fields},
        )
    _check(
        results,
        "accept/tli_override",
        lambda: resolve(["--speculative-draft-model-path", str(ckpt)], {"MOA_SGLANG_TLI": "0"}) is not None,
    )

    rejected = {
        "no_draft_path": ([], None),
        "eagle3_checkpoint": (["--speculative-draft-model-path", str(eagle3)], None),
        "chain_token_mismatch": (
            [
                "--speculative-draft-model-path",
                str(ckpt),
                "--speculative-num-steps",
                "3",
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                "6",
            ],
            None,
        ),
        "too_many_tokens": (
            [
                "--speculative-draft-model-path",
                str(ckpt),
                "--speculative-num-steps",
                "2",
                "--speculative-eagle-topk",
                "2",
                "--speculative-num-draft-tokens",
                "9",
            ],
            None,
        ),
        "zero_steps": (
            [
                "--speculative-draft-model-path",
                str(ckpt),
                "--speculative-num-steps",
                "0",
                "--speculative-eagle-topk",
                "2",
                "--speculative-num-draft-tokens",
                "3",
            ],
            None,
        ),
        "tp2": (["--speculative-draft-model-path", str(ckpt), "--tp-size", "2"], None),
        "page16": (["--speculative-draft-model-path", str(ckpt), "--page-size", "16"], None),
        "tli_out_of_range": (["--speculative-draft-model-path", str(ckpt)], {"MOA_SGLANG_TLI": "7"}),
        "tli_not_int": (["--speculative-draft-model-path", str(ckpt)], {"MOA_SGLANG_TLI": "one"}),
        "wrong_target": (
            ["--speculative-draft-model-path", str(ckpt), "--model-path", str(REPO / "drafters" / "smollm2-eagle3")],
            None,
        ),
    }
    for name, (extra, env) in rejected.items():

        def expect_error(extra=extra, env=env):
            try:
                resolve(extra, env)
            except Exception as e:  # noqa: BLE001
                return f"{type(e).__name__}: {e}"
            raise AssertionError("accepted")

        _check(results, f"reject/{name}", expect_error)

    def factory():
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

        sa = resolve(["--speculative-draft-model-path", str(ckpt)])
        cls = SpeculativeAlgorithm.from_string("MOA").create_worker(sa)
        return {"cls": f"{cls.__module__}.{cls.__name__}", "is_eagle_v2": issubclass(cls, EAGLEWorkerV2)}

    _check(results, "factory", factory)

    def draft_model_config():
        from sglang.srt.configs.model_config import ModelConfig

        sa = resolve(["--speculative-draft-model-path", str(ckpt)])
        mc = ModelConfig.from_server_args(sa, model_path=str(ckpt), is_draft_model=True)
        return {
            "archs": mc.hf_config.architectures,
            "layers": mc.num_hidden_layers,
            "kv_heads": mc.get_total_num_kv_heads(),
            "head_dim": mc.head_dim,
            "context_len": mc.context_len,
        }

    _check(results, "draft_model_config", draft_model_config)

    def eagle3_server_args():
        """SGLang's own EAGLE3 path accepts the shipped head for a target of SmolLM2-135M's shape."""
        from sglang.srt.configs.model_config import ModelConfig

        smol = work / "smollm2-shape"
        smol.mkdir()
        (smol / "config.json").write_text(
            json.dumps(
                dict(
                    architectures=["LlamaForCausalLM"],
                    model_type="llama",
                    vocab_size=49152,
                    hidden_size=576,
                    intermediate_size=1536,
                    num_hidden_layers=30,
                    num_attention_heads=9,
                    num_key_value_heads=3,
                    head_dim=64,
                    rms_norm_eps=1e-5,
                    rope_theta=100000.0,
                    max_position_embeddings=8192,
                    torch_dtype="bfloat16",
                    tie_word_embeddings=True,
                )
            )
        )
        sa = prepare_server_args(
            [
                "--model-path",
                str(smol),
                "--device",
                "cpu",
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                str(eagle3),
            ]
        )
        sa.resolve_once()
        v = resolved_view(sa)
        mc = ModelConfig.from_server_args(sa, model_path=str(eagle3), is_draft_model=True)
        return {
            "algo": v.speculative_algorithm,
            "shape": (v.speculative_num_steps, v.speculative_eagle_topk, v.speculative_num_draft_tokens),
            "draft_arch": mc.hf_config.architectures,
            "draft_layers": mc.num_hidden_layers,
        }

    _check(results, "eagle3_server_args", eagle3_server_args)
    _check(results, "process_group", lambda: _init_single_process_group() or True)

    def moa_model():
        from safetensors.torch import load_file
        from transformers import AutoConfig

        from sglang_ext.models.moa import load_moa
        from sglang_ext.sglang_plugin.models.moa_draft import MoADraftModel, expected_loaded_names

        model = MoADraftModel(AutoConfig.from_pretrained(str(ckpt)))
        state = load_file(str(ckpt / "model.safetensors"))
        loaded = model.load_weights(state.items())
        ref = load_moa(ckpt)
        g = torch.Generator().manual_seed(0)
        c = ref.cfg
        n = 5
        layer_kv = torch.randn(n, c.num_target_layers, c.lsa_hidden, generator=g)
        x = torch.randn(n, c.hidden_size, generator=g)
        pos = torch.randint(0, 100, (n,), generator=g)
        attn = torch.randn(n, c.num_heads, c.head_dim, generator=g)
        diffs = {
            "lsa": (model.lsa(layer_kv) - ref.lsa(layer_kv)).abs().max(),
            "sa_qkv": max((a - b).abs().max() for a, b in zip(model.sa_qkv(x, pos), ref.sa_qkv(x, pos))),
            "sa_finish": (model.sa_finish(attn, x) - ref.sa_finish(attn, x)).abs().max(),
            "ca_kv": max((a - b).abs().max() for a, b in zip(model.ca_kv(x, pos), ref.ca_kv(x, pos))),
            "ca_q": (model.ca_q(x, pos) - ref.ca_q(x, pos)).abs().max(),
            "ca_finish": (model.ca_finish(attn, x) - ref.ca_finish(attn, x)).abs().max(),
        }

        class WithReference:  # the SGLang model drafts; the embedded drafter gets the same weights
            def __init__(self, m, r):
                self.m, self.reference = m, r

            def __getattr__(self, name):
                return getattr(self.m, name)

        trees = draft_parity_case(WithReference(model, ref), tiny_target_model(), 1, "self", 4, 3, 10)
        return {
            "checkpoint_names": sorted(state),
            "consumed": sorted(model.loaded_weight_names),
            "loaded": sorted(loaded),
            "expected": sorted(expected_loaded_names(model)),
            "hot_ids_equal": torch.equal(model.hot_ids, ref.hot_ids),
            "max_diff": {k: float(v) for k, v in diffs.items()},
            "trees_equal": all(a == c and b == d for a, b, c, d in trees),
        }

    _check(results, "moa_model", moa_model)

    def eagle3_model():
        from sglang.srt.layers.rotary_embedding import base as rope_base
        from sglang.srt.utils.hf_transformers_utils import get_config

        from sglang_ext.models.checkpoint import read_weights

        # RotaryEmbedding picks a CPU kernel only under SGLANG_USE_CPU_ENGINE, which also needs
        # sgl_kernel (no CPU wheel); flip just the rope module's flag so the layer builds. RoPE has
        # no weights and nothing here runs a forward.
        rope_base._is_cpu = True
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

        cfg = get_config(str(eagle3), trust_remote_code=False)
        model = LlamaForCausalLMEagle3(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        state = read_weights(eagle3)  # the shipped head's shards, as SGLang's loader iterates them
        model.load_weights(state.items())
        unset = sorted(n for n, p in model.named_parameters() if torch.isnan(p).any())
        hot = model.hot_token_id
        return {
            "unset": unset,
            "hot_ok": hot is not None and torch.equal(hot, state["d2t"] + torch.arange(state["d2t"].numel())),
            "draft_vocab": int(cfg.draft_vocab_size),
            "aux": list(cfg.eagle_config["eagle_aux_hidden_state_layer_ids"]),
            "fc_in": int(model.model.fc.in_features),
            "qkv_ok": torch.equal(
                model.model.layers[0].self_attn.qkv_proj.weight[:576], state["midlayer.self_attn.q_proj.weight"].float()
            ),
        }

    _check(results, "eagle3_model", eagle3_model)

    def triton_vs_torch():
        from sglang_ext.attention.triton_tree import tree_attention_triton
        from sglang_ext.sglang_plugin.layout import (
            draft_block,
            draft_columns,
            next_visibility,
            step_columns,
            tree_step_plan,
        )

        out = []
        g = torch.Generator().manual_seed(1)
        for bs, topk, steps, dtype in [(2, 2, 3, torch.float32), (3, 3, 4, torch.float32), (2, 2, 3, torch.bfloat16)]:
            seq_lens = torch.randint(1, 40, (bs,), generator=g)
            width = draft_columns(steps, topk)
            req_to_token = torch.zeros(bs, 64, dtype=torch.long)
            perm = torch.randperm(400, generator=g) + 1
            for b in range(bs):
                req_to_token[b, : int(seq_lens[b]) + width] = perm[b * 100 : b * 100 + int(seq_lens[b]) + width]
            rpi = torch.arange(bs)
            block = draft_block(req_to_token, rpi, seq_lens, width)
            vis = next_visibility(None, None, step_columns(0, topk), width, bs)
            vis = next_visibility(vis, None, step_columns(1, topk), width, bs)
            vis = next_visibility(vis, torch.randint(topk, (bs, topk), generator=g), step_columns(2, topk), width, bs)
            used = int(step_columns(2, topk).max()) + 1
            for plan in (
                tree_step_plan(req_to_token, rpi, seq_lens, block[:, :used], vis[:, :, :used], topk),
                tree_step_plan(req_to_token, rpi, seq_lens, None, None, topk),
            ):
                q = torch.randn(bs * topk, 4, 16, generator=g).to(dtype)
                kp, vp = torch.randn(401, 2, 16, generator=g).to(dtype), torch.randn(401, 2, 16, generator=g).to(dtype)
                ref = tree_attention_torch(q.float(), kp.float(), vp.float(), plan, 0.25)
                out.append(float((tree_attention_triton(q, kp, vp, plan, 0.25).float() - ref).abs().max()))
        return out

    _check(results, "triton_vs_torch", triton_vs_torch)

    def pack_vs_sglang():
        from sglang.kernels.ops.speculative.pack_verify_mask import pack_verify_mask_into

        bs, n = 3, 5
        prefix = [3, 17, 0]
        masks = random_trees(9, bs, [n] * bs, prefix)
        slots = [torch.arange(m.shape[1]) for m in masks]
        fi = flashinfer_plan(plan_attention(slots, masks), with_mask=True)
        # SGLang's verify-graph packer: same uniform width n, kv_indptr per request
        kv_indptr = fi.kv_indptr.to(torch.int64)
        out = torch.zeros(int(fi.mask_indptr[-1]) + 8, dtype=torch.uint8)
        pack_verify_mask_into(
            torch.cat([m.flatten() for m in masks]),
            kv_indptr,
            fi.mask_indptr.to(torch.int64),
            out,
            batch_size=bs,
            query_width=n,
            max_kv_len=max(m.shape[1] for m in masks),
        )
        return {"equal": torch.equal(out[: fi.packed_mask.numel()], fi.packed_mask), "bytes": fi.packed_mask.numel()}

    _check(results, "pack_vs_sglang", pack_vs_sglang)
    torch.save(results, out_path)


# Light packages (all declared sglang dependencies) that importing SGLang's model, layer and worker
# modules needs on a CPU machine where sglang itself is installed --no-deps.
SGLANG_CPU_DEPS = {
    "torchvision": "torchvision==0.29.1",
    "tvm_ffi": "apache-tvm-ffi==0.1.11",
    "dill": "dill",
    "sentencepiece": "sentencepiece==0.2.1",
    "compressed_tensors": "compressed-tensors==0.18.0",
    "loguru": "loguru",
    "partial_json_parser": "partial-json-parser",
    "setproctitle": "setproctitle",
    "einops": "einops",
}


@pytest.fixture(scope="module")
def sglang_results(tmp_path_factory) -> dict:
    if not HAS_SGLANG:
        pytest.skip("sglang not installed")
    missing = [pkg for mod, pkg in SGLANG_CPU_DEPS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        pytest.skip(f"SGLang's model/worker modules need {' '.join(missing)} (pip install --no-deps)")
    out = tmp_path_factory.mktemp("sglang") / "results.pt"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET", "MOA_SGLANG_TLI", "MOA_SGLANG_DRAFT_ATTENTION")
    }
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out)],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def ok(results: dict, name: str):
    r = results[name]
    assert r["ok"], f"{name}: {r['error']}\n{r['trace']}"
    return r["value"]


def test_load_plugins_discovers_moa(sglang_results):
    v = ok(sglang_results, "discovered")
    assert ("moa_serve", "sglang_ext.sglang_plugin:register") in v["entry_points"]
    assert v["registered"] and v["model_registered"]
    assert v["autoconfig"] == "MoADraftHFConfig"


def test_from_string_resolves_moa(sglang_results):
    v = ok(sglang_results, "from_string")
    assert v["type"] == v["lower"] == "MoASpecAlgo" and v["name"] == "MOA"
    assert v["is_eagle"] and not v["is_eagle3"] and v["need_topk"] and not v["carries_hidden"]
    assert v["missing"] == [], "methods the scheduler may call on an algorithm object"


@pytest.mark.parametrize(
    "case,want",
    [
        ("defaults", (5, 4, 8)),
        ("chain", (3, 1, 4)),
        ("tree", (6, 8, 48)),
        ("chain_implicit_tokens", (2, 1, 3)),
    ],
)
def test_server_args_accept_moa(sglang_results, case, want):
    v = ok(sglang_results, f"accept/{case}")
    assert v["speculative_algorithm"] == "MOA"
    assert (v["speculative_num_steps"], v["speculative_eagle_topk"], v["speculative_num_draft_tokens"]) == want
    assert v["disable_overlap_schedule"] is True and v["page_size"] == 1 and v["max_running_requests"] == 48


def test_server_args_accept_tli_override(sglang_results):
    assert ok(sglang_results, "accept/tli_override") is True


@pytest.mark.parametrize(
    "case,phrase",
    [
        ("no_draft_path", "needs --speculative-draft-model-path"),
        ("eagle3_checkpoint", "use --speculative-algorithm EAGLE3"),
        ("chain_token_mismatch", "must be --speculative-num-steps + 1 = 4, got 6"),
        ("too_many_tokens", "num_draft_tokens must be in [2, 7]"),
        ("zero_steps", "--speculative-num-steps must be >= 1"),
        ("tp2", "--tp-size 1 only"),
        ("page16", "--page-size 1"),
        ("tli_out_of_range", "MOA_SGLANG_TLI=7 outside [0, 3]"),
        ("tli_not_int", "must be an integer"),
        ("wrong_target", "does not fit --model-path"),
    ],
)
def test_server_args_reject_bad_moa_settings(sglang_results, case, phrase):
    msg = ok(sglang_results, f"reject/{case}")
    assert phrase in msg, msg


def test_factory_returns_moa_worker(sglang_results):
    v = ok(sglang_results, "factory")
    assert v["cls"] == "sglang_ext.sglang_plugin.worker.MoAWorkerV2" and v["is_eagle_v2"]


def test_sglang_reads_moa_draft_config(sglang_results):
    v = ok(sglang_results, "draft_model_config")
    assert v["archs"] == ["MoADraftModel"]
    assert (v["layers"], v["kv_heads"], v["head_dim"]) == (2, 2, 8)  # draft pool: SA + CA layers, target's KV shape


def test_moa_checkpoint_loads_into_sglang_model_every_weight_consumed(sglang_results):
    ok(sglang_results, "process_group")
    v = ok(sglang_results, "moa_model")
    assert v["consumed"] == v["checkpoint_names"]
    assert v["loaded"] == v["expected"], "every parameter (every shard of fused ones) written exactly by the checkpoint"
    assert v["hot_ids_equal"]


def test_sglang_moa_model_equals_embedded_moa(sglang_results):
    v = ok(sglang_results, "moa_model")
    for piece, diff in v["max_diff"].items():
        assert diff < 1e-5, f"{piece}: {diff}"
    assert v["trees_equal"], "draft_core with the SGLang-layer model drafts the embedded drafter's trees"


def test_shipped_eagle3_head_loads_into_sglang_eagle3(sglang_results):
    """drafters/smollm2-eagle3 has every config field LlamaForCausalLMEagle3 reads, and every
    parameter except the (target-shared) embedding is written by the checkpoint."""
    v = ok(sglang_results, "eagle3_model")
    assert v["unset"] == ["model.embed_tokens.weight"]
    assert v["hot_ok"] and v["qkv_ok"]
    assert v["draft_vocab"] == 8192 and v["aux"] == [1, 14, 26] and v["fc_in"] == 3 * 576


def test_sglang_eagle3_server_args_accept_shipped_head(sglang_results):
    v = ok(sglang_results, "eagle3_server_args")
    assert v["algo"] == "EAGLE3" and tuple(v["shape"]) == (5, 4, 8)  # SGLang's auto choice for Llama targets
    assert v["draft_arch"] == ["LlamaForCausalLMEagle3"] and v["draft_layers"] == 1


def test_triton_tree_attention_equals_torch_on_worker_plans(sglang_results):
    for diff in ok(sglang_results, "triton_vs_torch"):
        assert diff < 2e-2  # bf16 cases included; fp32 cases are ~1e-6
    assert max(ok(sglang_results, "triton_vs_torch")[:4]) < 1e-4


def test_packed_mask_equals_sglang_pack_kernel(sglang_results):
    v = ok(sglang_results, "pack_vs_sglang")
    assert v["equal"] and v["bytes"] > 0


# --- GPU only ------------------------------------------------------------------------------------------


@gpu
@pytest.mark.skipif(
    not HAS_CUDA or importlib.util.find_spec("flashinfer") is None, reason="needs a CUDA device and flashinfer"
)
def test_flashinfer_tree_attention_equals_torch_gpu():
    from sglang_ext.attention.flashinfer_plan import FlashInferTreeAttention

    masks = random_trees(4, 3, [6, 9, 3], [20, 0, 33])
    slots = [torch.randperm(500)[: m.shape[1]] + 1 for m in masks]
    plan = plan_attention(slots, masks)
    q = torch.randn(plan.num_queries, 8, 64, device="cuda", dtype=torch.bfloat16)
    kp = torch.randn(501, 2, 64, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn(501, 2, 64, device="cuda", dtype=torch.bfloat16)
    ref = tree_attention_torch(q.float(), kp.float(), vp.float(), plan, 0.125)
    attention = FlashInferTreeAttention()
    for _ in range(2):  # the second layer of the step reuses the planned wrapper
        torch.testing.assert_close(attention(q, kp, vp, plan, 0.125).float(), ref, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_triton_tree_attention_replays_in_cuda_graph_gpu():
    from sglang_ext.attention.triton_tree import tree_attention_triton

    masks = random_trees(5, 2, [8, 8], [30, 12])
    slots = [torch.randperm(300)[: m.shape[1]] + 1 for m in masks]
    plan = plan_attention(slots, masks)
    q = torch.randn(plan.num_queries, 8, 64, device="cuda")
    kp, vp = torch.randn(301, 2, 64, device="cuda"), torch.randn(301, 2, 64, device="cuda")
    eager = tree_attention_triton(q, kp, vp, plan, 0.125)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention_triton(q, kp, vp, plan, 0.125)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(out, tree_attention_triton(q, kp, vp, plan, 0.125))
    assert not torch.equal(out, eager)


@gpu
@pytest.mark.skipif(
    not HAS_CUDA or not (REPO / "drafters" / "smollm2-moa-tli1" / "config.json").is_file(),
    reason="needs a CUDA device, the full sglang install and drafters/smollm2-moa-tli1",
)
def test_sglang_server_with_moa_matches_plain_decoding_gpu():
    """End to end: greedy output of `launch_server --speculative-algorithm MOA` equals the same
    server without speculation, and the server reports an accept length > 1."""
    import requests

    from sglang_ext.models.loader import resolve_target

    target = str(resolve_target("smollm2"))
    prompts = ["The capital of France is", "def fibonacci(n):"]

    def serve(port, extra):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                target,
                "--port",
                str(port),
                "--dtype",
                "bfloat16",
                *extra,
            ]
        )
        try:
            for _ in range(600):
                try:
                    if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                        break
                except requests.RequestException:
                    pass
                import time

                time.sleep(1)
            outs = [
                requests.post(
                    f"http://127.0.0.1:{port}/generate",
                    json={"text": p, "sampling_params": {"temperature": 0, "max_new_tokens": 64}},
                    timeout=120,
                ).json()
                for p in prompts
            ]
            return [o["text"] for o in outs], [o["meta_info"].get("spec_accept_length", 1.0) for o in outs]
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    plain, _ = serve(30111, [])
    moa, accept = serve(
        30112,
        [
            "--speculative-algorithm",
            "MOA",
            "--speculative-draft-model-path",
            str(REPO / "drafters" / "smollm2-moa-tli1"),
        ],
    )
    assert moa == plain
    assert min(accept) > 1.0


if __name__ == "__main__":  # the SGLang side: TRITON_INTERPRET=1 python tests/sglang_ext/test_sglang_plugin.py OUT
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
    torch.set_num_threads(1)
    run_sglang_checks(sys.argv[1])
