"""The engine on a real GPU (`gpu` marker: skipped without CUDA), SmolLM2-135M in bf16 as served there.

- Greedy identity: every registered drafter, bs 1 and 4, against vanilla decoding in the same dtype on
  the same device. bf16 rounds the verify forward (N rows) and a decode (1 row) differently, so a
  divergence is excused only at a numerical tie of the target, here within BF16_TIE of its top-2 logits
  (fp32 on a CPU: 1e-3); the ties are counted and must stay a minority.
- One device-to-host copy per engine step on the device: CUDA's sync debug mode counts every
  synchronizing call of vanilla steps and of steps drafted by each kind of drafter, graphs on and off.
The chi-square law of the engine's sampling on CUDA is in tests/sglang_ext/test_distribution.py, and
Triton vs the torch reference attention on CUDA in tests/sglang_ext/test_device_step.py.
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path

import pytest
import torch
from helpers import compare_to_reference, slots_whole

from serving.config import EngineConfig
from serving.engine import Engine, build_engine
from sglang_ext.drafters import available_drafters, default_tree
from sglang_ext.evalsets import load_eval_set
from sglang_ext.models.checkpoint import CheckpointError
from sglang_ext.sampling import SamplingParams

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32
BF16_TIE = 0.5  # bf16 logits of SmolLM2 (|x| ~ 10-30) are spaced 0.06-0.125 apart; orders of summation differ
DRAFTERS = [n for n in available_drafters() if n not in ("none", "auto") and n.replace("-", "").isalnum()]


@pytest.fixture(scope="module")
def prompts(smollm2_cuda):
    texts = load_eval_set("builtin")[1][:8]
    return [smollm2_cuda.encode_chat([{"role": "user", "content": t[:600]}]) for t in texts]


@pytest.fixture(scope="module")
def vanilla(smollm2_cuda, prompts):
    eng = Engine(smollm2_cuda, None)
    return [eng.generate([p], SamplingParams(max_new_tokens=NEW_TOKENS))[0].output_ids for p in prompts]


def _engine(target, name: str, cuda_graphs: bool = True) -> Engine:
    config = EngineConfig(drafter=name, tree=default_tree(name), adaptive=False, cuda_graphs=cuda_graphs)
    try:
        return build_engine(config, target=target)
    except CheckpointError as e:  # a model drafter without its checkpoint on this machine
        pytest.skip(str(e))


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_gpu_greedy_identity(smollm2_cuda, prompts, vanilla, drafter, bs):
    eng = _engine(smollm2_cuda, drafter)
    assert eng.drafter is not None and eng.kv.device.type == "cuda"
    outs = []
    for i in range(0, len(prompts), bs):
        reqs = eng.generate(prompts[i : i + bs], SamplingParams(max_new_tokens=NEW_TOKENS))
        outs += [r.output_ids for r in reqs]
    model = smollm2_cuda.model
    verdicts = [compare_to_reference(model, p, r, o, BF16_TIE) for p, r, o in zip(prompts, vanilla, outs)]
    print(f"{drafter}/bs{bs}: {verdicts.count('same')} same, {verdicts.count('tie')} ties, {verdicts}")
    assert "bug" not in verdicts, f"{drafter}/bs{bs}: output differs from vanilla away from a numerical tie"
    assert verdicts.count("tie") <= len(prompts) // 4, "too many ties: the comparison would prove little"
    assert slots_whole(eng), "KV slots leaked"


def _graphs(eng: Engine) -> int:
    """CUDA graphs captured so far by the engine's runner and its drafter's step and search runners."""
    runners = [eng.runner.graph_runner, getattr(eng.drafter, "_steps", None), getattr(eng.drafter, "_search", None)]
    return sum(len(r.cache.entries) for r in runners if r is not None)


def _syncs_per_step(eng: Engine, steps: int) -> tuple[list[int], list[tuple[str, int]]]:
    """The synchronizing CUDA calls of each of `steps` engine steps (sync debug mode 'warn') that captured
    no new graph (a capture synchronizes: a new context bucket can open a new one at any step), and
    where they were made (file:line of the Python call, most frequent first). A copy queued through the runner's
    stream (the overlapped loop's: into pinned memory, an event waited for, no synchronizing call) counts as one."""
    counts, sites = [], collections.Counter()
    stream = eng.runner.stream
    for _ in range(steps):
        torch.cuda.synchronize()
        before, copies = _graphs(eng), stream.copies if stream is not None else 0
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if _graphs(eng) == before:
            # (not torch's one-time "prototype feature ... synchronizing operations" notice of the mode itself)
            syncs = [w for w in seen if "called a synchronizing CUDA operation" in str(w.message)]
            counts.append(len(syncs) + (stream.copies - copies if stream is not None else 0))
            sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return counts, sites.most_common(12)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("drafter", [None, "ngram", "lookahead", "eagle3", "moa", "medusa", "draft-model"])
def test_gpu_a_greedy_step_synchronizes_once(smollm2_cuda, prompts, drafter, graphs):
    """After the prefill, each decode step of a batch of 4 greedy requests makes one synchronizing call:
    the copy of the accepted paths (lookup trees are built on the host and go up in one queued copy; a
    model drafter searches on the device without reading it), with CUDA graphs replayed or eager; vanilla
    with graphs: the overlapped loop's copy, queued through the runner's stream and waited for by an event."""
    if drafter is None:
        eng = Engine(smollm2_cuda, None, EngineConfig(cuda_graphs=graphs))
    else:
        eng = _engine(smollm2_cuda, drafter, graphs)
    for p in prompts[:4]:
        eng.add_request(p, SamplingParams(max_new_tokens=2 * NEW_TOKENS, ignore_eos=True))
    eng.step()  # the prefill
    for _ in range(2):  # the first decode steps capture their graphs (a capture synchronizes)
        eng.step()
    counts, sites = _syncs_per_step(eng, 8)
    assert len(counts) >= 4 and counts == [1] * len(counts), (counts, sites)
    while eng.has_work:
        eng.step()


@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_gpu_output_logprobs_come_in_the_one_copy(smollm2_cuda, prompts, drafter):
    """Requests asking for logprobs (top 2) add no synchronizing call: they come with the accepted paths."""
    eng = Engine(smollm2_cuda, None) if drafter is None else _engine(smollm2_cuda, drafter)
    for p in prompts[:4]:
        eng.add_request(p, SamplingParams(max_new_tokens=2 * NEW_TOKENS, ignore_eos=True, logprobs=2))
    eng.step()  # the prefill
    for _ in range(2):  # the first decode steps capture their graphs (a capture synchronizes)
        eng.step()
    counts, sites = _syncs_per_step(eng, 8)
    assert len(counts) >= 4 and counts == [1] * len(counts), (counts, sites)
    reqs = list(eng.running)
    while eng.has_work:
        eng.step()
    assert reqs and all(len(r.output_logprobs) == len(r.output_ids) for r in reqs)
