"""Drafters and trees on the target's device, checked on the CPU (meta and fake CUDA tensors).

A model drafter built for a target on a device holds everything there: its weights and buffers in the
target's dtype, its plain tensor attributes (RoPE frequencies, kept in fp32) and its KV pools. Trees
reach the engine's forward on the target's device: host-built ones (lookup drafters, root-only trees)
go up in one copy per dtype (`trees_on`), device-built ones stay as they are.
"""

from __future__ import annotations

import pytest
import torch
from helpers import HostWaits, static_runs, tiny_config, tiny_state
from torch._subclasses.fake_tensor import FakeTensorMode

from sglang_ext.attention import tree_attention_torch
from sglang_ext.drafters import DraftModelDrafter
from sglang_ext.drafters.base import DraftInput, TargetCapture
from sglang_ext.drafters.eagle3 import Eagle3Drafter
from sglang_ext.drafters.medusa import MedusaDrafter
from sglang_ext.drafters.moa import MoADrafter
from sglang_ext.models import LlamaModel
from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft
from sglang_ext.models.medusa import MedusaConfig, MedusaHeads
from sglang_ext.models.moa import MoAConfig, MoADraft
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TokenTree, TreeShape, chain_tree, root_tree, trees_on

CFG = tiny_config(vocab=64, layers=6)


def _tensors(module: torch.nn.Module):
    """(name, tensor) for every parameter, buffer and plain tensor attribute of the module."""
    yield from module.named_parameters()
    yield from module.named_buffers()
    for prefix, m in module.named_modules():
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                yield f"{prefix}.{name}", value


def _drafter(kind: str, model: LlamaModel):
    if kind == "eagle3":
        return Eagle3Drafter(model, Eagle3Draft(Eagle3Config.for_target(CFG, 48)), num_slots=64)
    return MoADrafter(model, MoADraft(MoAConfig.for_target(CFG, tli=1, draft_vocab_size=48)), num_slots=64)


# NOTE: the meta device stands for the accelerator here: a module moves to it as to a GPU (fake CUDA
# tensors cannot be swapped into an nn.Module's parameters), and nothing on it can be read either


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["eagle3", "moa"])
def test_model_drafters_live_beside_the_target(kind, dtype):
    model = LlamaModel(CFG, tiny_state(CFG), dtype=dtype, device="meta")
    drafter = _drafter(kind, model)
    found = list(_tensors(drafter.draft))
    assert found and all(t.is_meta for _, t in found), [n for n, t in found if not t.is_meta]
    assert all(t.dtype == dtype for t in drafter.draft.parameters())
    assert drafter.draft.inv_freq.dtype == torch.float32  # RoPE frequencies keep fp32
    pools = [drafter.kv] if kind == "eagle3" else [drafter.mem, drafter.sa]
    assert all(p.device.type == "meta" for p in pools)
    assert drafter.hot_ids.is_meta
    if kind == "moa":
        assert drafter.head.is_meta and drafter.head.dtype == dtype


def test_the_draft_model_drafter_shares_the_targets_device():
    model = LlamaModel(CFG, tiny_state(CFG), device="meta")
    drafter = DraftModelDrafter.self_draft(model, layers=[0, 5], num_slots=64)
    assert drafter.model.device.type == "meta" and drafter.kv.device.type == "meta"
    assert drafter.model.embed is model.embed  # shared, not copied


def test_trees_on_uploads_host_trees_and_keeps_device_ones():
    host = [chain_tree(1, [2, 3, 4], 7), root_tree(6, 12)]  # built (and checked) on the host
    probs = chain_tree(1, [2], 3, draft_probs=torch.zeros(2, 8))  # a sampled chain: float rows too
    with FakeTensorMode(allow_non_fake_inputs=True):
        device_tree = chain_tree(3, [4, 5], 9, device="cuda")
        placed = trees_on([host[0], device_tree, host[1], probs], "cuda")
        assert placed[1] is device_tree
        for t in placed:
            for name, value in vars(t).items():
                assert value is None or value.device.type == "cuda", name


def test_trees_on_keeps_the_values_and_root_tree_is_a_root_only_chain():
    trees = [chain_tree(1, [2, 3], 7), root_tree(6, 12)]
    assert all(a is b for a, b in zip(trees_on(trees, "cpu"), trees))
    for got, want in ((root_tree(6, 12), chain_tree(6, [], 12)), (root_tree(0, 0), chain_tree(0, [], 0))):
        for name in TokenTree.__dataclass_fields__:
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or torch.equal(a, b), name


# --- a propose reads nothing back from the device ----------------------------------------------------
# The target and the drafter live on the meta device (standing for a GPU: a meta tensor holds no
# values, so `int(t)`, `bool(t)`, `.tolist()`, a boolean-mask gather or `nonzero` on it raises, and so
# does a host tensor mixed into its math), while slot ids and other host values stay real CPU tensors,
# as they do beside a GPU. Every path of a search runs: the EAGLE-2 tree with min_prob, greedy chains,
# sampled chains (seeded generators on the host cannot draw on a device: unseeded here), batches of
# several requests, the eager plans and the static (graph-runner) steps, then the commit of a step.


def _meta_drafter(kind: str, model: LlamaModel):
    if kind == "draft-model":
        return DraftModelDrafter.self_draft(model, layers=[0, 5], num_slots=256)
    if kind == "eagle3":
        return Eagle3Drafter(model, Eagle3Draft(Eagle3Config.for_target(CFG, 48)), num_slots=256)
    if kind == "medusa":
        return MedusaDrafter(model, MedusaHeads(MedusaConfig.for_target(CFG, num_heads=3, draft_vocab_size=48)))
    tli = 0 if kind == "moa-tli0" else 1
    return MoADrafter(model, MoADraft(MoAConfig.for_target(CFG, tli=tli, draft_vocab_size=48)), num_slots=256)


def _capture(drafter, model: LlamaModel, kv, tokens: list[int], slots: torch.Tensor, first: int) -> TargetCapture:
    n = len(tokens)
    hidden = {l: torch.randn(n, CFG.hidden_size, device="meta") for l in drafter.capture_layers}
    return TargetCapture(tokens, torch.arange(first, first + n, device="meta"), slots, hidden, kv)


SHAPES = {
    "tree": (TreeShape(3, 2, 6, min_prob=0.1), SamplingParams()),
    "greedy-chain": (TreeShape.chain(3), SamplingParams()),
    "sampled-chain": (TreeShape.chain(3), SamplingParams(temperature=0.8, top_p=0.9, top_k=20)),
}


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["eagle3", "moa", "moa-tli0", "draft-model", "medusa"])
def test_a_propose_reads_nothing_from_the_device(kind, shape, static):
    tree_shape, params = SHAPES[shape]
    model = LlamaModel(CFG, tiny_state(CFG), device="meta")
    model.attention = tree_attention_torch
    drafter = _meta_drafter(kind, model)
    drafter.step_graphs = static  # the FrontierRunner's static path (eager off CUDA: graphs need a GPU)
    kv = model.new_kv_pool(256)
    prompts = [list(range(3, 3 + n)) for n in (7, 12)]
    held = {}
    for rid, p in enumerate(prompts):
        held[rid] = kv.alloc(len(p))
        drafter.add_request(rid, _capture(drafter, model, kv, p, held[rid], 0))
    for _ in range(2):  # a propose, a commit of what was verified, and the next propose
        batch = [DraftInput(rid, p + [1], params, None) for rid, p in enumerate(prompts)]
        with HostWaits() as waits:  # nor makes the host wait on a copy up (host indices, scalar writes)
            trees = drafter.propose(batch, tree_shape)
        assert not waits.raised, waits.raised
        assert len(trees) == 2
        for t in trees:
            assert t.draft_tokens.device.type == "meta" and t.tree_mask.device.type == "meta"
            assert t.finite is not None and t.finite.device.type == "meta"
            assert (t.draft_probs is not None) == (shape == "sampled-chain" and kind != "medusa")
        for rid, p in enumerate(prompts):  # the target verified the root and one draft token
            s = kv.alloc(2)
            drafter.commit(rid, _capture(drafter, model, kv, [1, 2], s, len(p)))
            held[rid] = torch.cat([held[rid], s])
            prompts[rid] = p + [1, 2]
    if (
        static and kind != "medusa" and (shape != "sampled-chain" or kind == "draft-model")
    ):  # (others' sampled chains: full vocab, eager)
        assert static_runs(drafter) > 0
    for rid in held:
        drafter.remove_request(rid)
