"""Greedy identity at the q8 dtype (the CPU default where AVX-512 VNNI runs): every drafter's output is vanilla's
at q8, token for token. q8's rows are batch-invariant end to end (matmuls, attention and prompt blocks alike:
tests/sglang_ext/test_q8.py), so there are no numerical ties to allow here, unlike fp32's test_engine.py."""

import pytest
from helpers import drafter_pools_whole, slots_whole

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext import kernels
from sglang_ext.drafters import default_tree, make_drafter
from sglang_ext.sampling import SamplingParams

pytestmark = pytest.mark.skipif(kernels.q8_unavailable() is not None, reason=f"q8: {kernels.q8_unavailable()}")

NEW_TOKENS = 24
DRAFTERS = ["ngram", "suffix", "lookahead", "draft-model", "eagle3", "moa", "moa-tli0", "medusa", "suffix+eagle3"]


@pytest.fixture(scope="module")
def prompts(eval_prompts):
    """A prompt of four eval sets (eval_prompts holds four per set, in order)."""
    return eval_prompts[1::6][:4]


@pytest.fixture(scope="module")
def vanilla(smollm2_q8, prompts):
    eng = Engine(smollm2_q8, None)
    return [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_is_vanilla_at_q8(smollm2_q8, prompts, vanilla, drafter):
    """At its default tree: two prompts alone, two in one batch (requests finishing apart), each equal to
    vanilla's output (vanilla itself decoded all four in one batch), with no request falling back to vanilla."""
    fallbacks = []
    eng = Engine(
        smollm2_q8,
        make_drafter(drafter, smollm2_q8),
        EngineConfig(tree=default_tree(drafter)),
        on_fallback=lambda req, reason: fallbacks.append(reason),
    )
    sp = SamplingParams(max_new_tokens=NEW_TOKENS)
    alone = [eng.generate([p], sp)[0].output_ids for p in prompts[1::2]]
    batched = [r.output_ids for r in eng.generate(prompts[0::2], sp)]
    assert fallbacks == [], f"{drafter} fell back to vanilla: {fallbacks}"
    assert alone == vanilla[1::2], drafter
    assert batched == vanilla[0::2], drafter
    assert slots_whole(eng), "KV slots leaked"
    assert drafter_pools_whole(eng.drafter), "drafter state leaked"
