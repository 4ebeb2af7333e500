"""Bench peers and per-position acceptance: arithmetic from known accept sequences, failed and
skipped peers reported, and the transformers peers running for real on a tiny model."""

import json

import pytest
from helpers import tiny_config, tiny_state

from moa_serve.benchmarks.bench import (
    MethodResult,
    acceptance_by_position,
    acceptance_table,
    add_runner,
    markdown_table,
    plot_acceptance,
    pooled_acceptance,
    run_interleaved,
)
from moa_serve.benchmarks.peers import (
    PeerStats,
    PeerUnavailable,
    hf_runner,
    hf_self_draft_assistant,
    layer_ranges,
    stats_from_steps,
    target_gguf,
)
from serving.engine import RequestStats
from sglang_ext.sampling import SamplingParams


def stats_for(accepts: list[int], drafted_per_step: int) -> RequestStats:
    """What the engine's _record makes of these per-step accept counts."""
    st = RequestStats()
    for a in accepts:
        st.verify_steps += 1
        st.draft_tokens += drafted_per_step
        st.accepted_tokens += a
        st.accepted_by_depth += [0] * (a - len(st.accepted_by_depth))
        for i in range(a):
            st.accepted_by_depth[i] += 1
    return st


def test_acceptance_by_position_from_known_accepts():
    # per-step accepts 2, 0, 3, 1 on a depth-4 chain: position i is accepted in the steps with >= i accepts
    assert acceptance_by_position([3, 2, 1], 4, depth=4) == [0.75, 0.5, 0.25, 0.0]
    assert acceptance_by_position([], 0, depth=4) == []
    prompts = {"p1": [2, 0], "p2": [3, 1]}  # two prompts, pooled over both

    def run(prompt):
        return [7] * 5, stats_for(prompts[f"p{prompt[0]}"], 4)

    res = MethodResult("ngram", "s", "4,1,4")
    run_interleaved({"ngram": (res, run)}, [[1], [2]], warmup=0)
    assert res.accepted_by_depth == [3, 2, 1] and res.verify_steps == 4 and res.accepted == 6
    assert res.acceptance_by_position == [0.75, 0.5, 0.25, 0.0]  # padded to the tree depth
    assert res.tau == (6 + 4) / 4
    other = MethodResult("ngram", "t", "4,1,4", verify_steps=4, accepted_by_depth=[1])
    assert pooled_acceptance([res, other])["ngram 4,1,4"] == [
        0.5,
        0.25,
        0.125,
        0.0,
    ]  # counts summed over eval sets, then divided
    table = acceptance_table([res, MethodResult("vanilla", "s", "-", verify_steps=10)])
    assert "| s | ngram | 4,1,4 | 4 | 0.75 | 0.50 | 0.25 | 0.00 |" in table and "vanilla" not in table


def test_peer_stats_from_recorded_forwards():
    # prompt of 5; prefill (no drafts), then a step accepting 2 of 3, one accepting 0 of 3, the last 2 of 2
    st = stats_from_steps([(5, 0), (6, 3), (9, 3), (10, 2)], final_len=13)
    assert (st.verify_steps, st.draft_tokens, st.accepted_tokens, st.accepted_by_depth, st.max_draft) == (
        3,
        8,
        4,
        [2, 2],
        3,
    )
    # transformers' assisted loop verifies drafts already in its first forward: that one is a verify step
    st = stats_from_steps([(5, 4), (8, 4)], final_len=9)
    assert (st.verify_steps, st.accepted_tokens, st.accepted_by_depth) == (2, 2, [1, 1])
    # the last step clipped by max_new_tokens: only the tokens kept count as accepted
    st = stats_from_steps([(5, 0), (6, 5)], final_len=8)
    assert st.accepted_tokens == 1 and st.accepted_by_depth == [1]


def test_failing_and_skipped_peers_are_rows_with_the_reason(tmp_path):
    runners: dict = {}

    def flaky(prompt):
        if prompt[0] == 2:
            raise RuntimeError("llama_decode returned -1")
        return [1, 2], None

    add_runner(runners, MethodResult("vanilla", "s", "-"), lambda: lambda p: ([1, 2], RequestStats(verify_steps=1)))
    add_runner(runners, MethodResult("flaky-peer", "s", "-"), lambda: flaky)
    add_runner(runners, MethodResult("llama.cpp", "s", "-"), lambda: target_gguf("/some/hf/dir"))
    add_runner(runners, MethodResult("broken", "s", "-"), lambda: (_ for _ in ()).throw(ImportError("no module")))
    run_interleaved({k: v for k, v in runners.items() if v[1] is not None}, [[1], [2], [3]], warmup=0)
    rows = [r for r, _ in runners.values()]
    by = {r.method: r for r in rows}
    assert len(rows) == 4
    assert by["flaky-peer"].error == "RuntimeError: llama_decode returned -1" and by["flaky-peer"].prompts == 1
    assert by["llama.cpp"].error.startswith("skipped: --model /some/hf/dir is a Hugging Face directory")
    assert by["broken"].error == "ImportError: no module"
    table = markdown_table(rows)
    assert "| s | llama.cpp | - | skipped: --model /some/hf/dir" in table and "failed: skipped" not in table
    assert "| s | flaky-peer | - | failed: RuntimeError: llama_decode returned -1 |" in table
    assert "n/a (sampling)" in markdown_table(
        [by["vanilla"], MethodResult("ngram", "s", "6,2,12", tokens=2, seconds=1.0, prompts=1)], sampling=True
    )
    assert not plot_acceptance(rows, tmp_path / "a.png")  # nothing speculative: no plot, no crash


def tiny_hf_model(layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = tiny_config(vocab=32, layers=layers)
    hc = LlamaConfig(**c.to_hf())
    model = LlamaForCausalLM(hc)
    model.load_state_dict(tiny_state(c), strict=True)
    return model.eval()


PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # repeats, so prompt lookup finds drafts


def test_hf_prompt_lookup_and_assisted_peers_run_on_a_tiny_model():
    hf = tiny_hf_model()
    greedy = SamplingParams(max_new_tokens=8)
    plain, none = hf_runner(hf, greedy, [])(PROMPT)
    assert len(plain) == 8 and none is None  # plain generate reports no speculation stats

    out, st = hf_runner(hf, greedy, [], prompt_lookup_num_tokens=3)(PROMPT)
    assert out == plain  # greedy prompt lookup is lossless
    assert isinstance(st, PeerStats) and st.verify_steps > 0 and st.draft_tokens > 0 and st.max_draft <= 3
    assert st.accepted_tokens + st.verify_steps <= len(out) <= st.accepted_tokens + st.verify_steps + 1  # +1: a prefill

    assistant = hf_self_draft_assistant(hf, [0, 3])
    assert (
        assistant.model.layers[1].self_attn.q_proj.weight.data_ptr()
        == hf.model.layers[3].self_attn.q_proj.weight.data_ptr()
    )  # shared, not copied
    assert len(assistant.model.layers) == 2 and assistant.model.layers[1].self_attn.layer_idx == 1
    out, st = hf_runner(hf, greedy, [], assistant_model=assistant)(PROMPT)
    assert out == plain and st.verify_steps > 0 and st.draft_tokens > 0
    assert sum(st.accepted_by_depth) == st.accepted_tokens


def test_hf_peers_sample_seeded():
    hf = tiny_hf_model()
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=3)
    run = hf_runner(hf, sp, [], prompt_lookup_num_tokens=3)
    a, st = run(PROMPT)
    assert run(PROMPT)[0] == a and len(a) == 6 and st.verify_steps > 0  # the same seed gives the same sample
    b, _ = hf_runner(hf, sp, [], assistant_model=hf_self_draft_assistant(hf, [0, 3]))(PROMPT)
    assert len(b) == 6


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 3, 4, 5, 6, 28, 29]) == "0-6,28-29" and layer_ranges([3]) == "3"


def test_llama_cpp_peer_on_the_target_gguf():
    pytest.importorskip("llama_cpp", reason="optional peer: `make bench-peers` builds llama-cpp-python")
    from moa_serve.benchmarks.peers import llama_cpp_runner

    try:
        gguf = target_gguf("smollm2")
    except PeerUnavailable as e:
        pytest.skip(str(e))
    prompt = [504, 3458, 28, 253, 1789, 30, 504, 3458, 28, 253, 1789, 30, 504, 3458]
    plain, none = llama_cpp_runner(gguf, SamplingParams(max_new_tokens=6), [], 64, 1)(prompt)
    assert len(plain) == 6 and none is None
    run = llama_cpp_runner(gguf, SamplingParams(max_new_tokens=6), [], 64, 1, lookup_tokens=4)
    out, st = run(prompt)
    assert out == plain and st.verify_steps > 0  # greedy prompt lookup is lossless
    assert run(prompt)[0] == out  # the context is reset between prompts
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.95, seed=5)
    sampled = llama_cpp_runner(gguf, sp, [], 64, 1, lookup_tokens=4)
    assert len(sampled(prompt)[0]) == 6


@pytest.mark.slow
def test_bench_quick_with_peers_and_sampling(tmp_path):
    from moa_serve.entrypoints.cli import main

    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "--quick",
            "--eval-sets",
            "builtin",
            "--methods",
            "ngram",
            "--peers",
            "hf-assisted,hf-prompt-lookup,llama.cpp,nope",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--seed",
            "1",
            "--dtype",
            "float32",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    by = {r["method"]: r for r in data["results"]}
    assert data["sampling"]["temperature"] == 0.7
    assert by["ngram"]["verify_steps"] > 0 and len(by["ngram"]["acceptance_by_position"]) == 6
    assert by["hf-assisted"]["error"] is None and by["hf-assisted"]["verify_steps"] > 0
    assert by["hf-prompt-lookup"]["error"] is None and by["hf-prompt-lookup"]["tokens"] > 0
    assert by["llama.cpp"]["error"] is None or by["llama.cpp"]["skipped"]
    assert "unknown peer" in by["nope"]["error"]
    assert (out / "acceptance_by_position.png").stat().st_size > 1000
    assert "n/a (sampling)" in (out / "table.md").read_text()
