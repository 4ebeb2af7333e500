"""One engine config and one builder: EngineConfig, build_engine, the drafters' default trees in their
registry entries, --device, and the generation flags `generate` and `edge` share."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_target

import serving.engine as engine_mod
from moa_serve.entrypoints.cli import build_parser, main
from moa_serve.entrypoints.flags import engine_config, sampling_params
from serving.config import EngineConfig
from serving.engine import Engine, build_engine
from sglang_ext.drafters import _REGISTRY as REGISTRY
from sglang_ext.drafters import (
    FALLBACK_TREE,
    NgramDrafter,
    default_tree,
    drafter_kind,
    make_drafter,
    register_drafter,
)
from sglang_ext.models import load_target, resolve_device
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

EAGLE_LIKE = TreeShape(1, 2, 3, min_prob=0.1)


@pytest.fixture
def no_model_load(monkeypatch):
    """build_engine must fail before it loads a model."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_mod, "load_target", refuse)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_registry_entries_carry_their_default_trees():
    expected = {
        "ngram": TreeShape(6, 2, 12),
        "suffix": TreeShape(3, 1, 4),
        "lookahead": TreeShape(3, 1, 4),  # a chain of its window (W = 3)
        "draft-model": TreeShape(3, 1, 4),
        "eagle3": EAGLE_LIKE,
        "moa": EAGLE_LIKE,
        "moa-tli0": EAGLE_LIKE,
        "moa-tli1": EAGLE_LIKE,
        "medusa": TreeShape(3, 2, 6, min_prob=0.1),
    }
    assert {name: spec.default_tree for name, spec in REGISTRY.items()} == expected
    assert {name: default_tree(name) for name in expected} == expected
    assert default_tree("none") == default_tree(None) == default_tree("no-such-drafter") == FALLBACK_TREE


def test_a_directory_resolves_to_its_kind(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "config.json").write_text(json.dumps({"kind": "suffix-corpus"}))
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert drafter_kind(str(corpus)) == "suffix" and default_tree(str(corpus)) == TreeShape(3, 1, 4)
    assert drafter_kind(str(eagle)) == "eagle3" and default_tree(str(eagle)) == EAGLE_LIKE
    assert drafter_kind(str(tmp_path)) is None and default_tree(str(tmp_path)) == FALLBACK_TREE


def test_register_drafter_takes_a_default_tree(monkeypatch):
    monkeypatch.setitem(REGISTRY, "mine", None)  # restored after the test
    register_drafter("mine", lambda target: NgramDrafter(), TreeShape(2, 1, 3))
    assert default_tree("mine") == TreeShape(2, 1, 3)
    assert isinstance(make_drafter("mine", tiny_target()), NgramDrafter)
    register_drafter("mine", lambda target: NgramDrafter())
    assert default_tree("mine") == FALLBACK_TREE


def test_build_engine_uses_the_drafters_default_tree_unless_one_is_given():
    target = tiny_target()
    engine = build_engine(EngineConfig(drafter="ngram", kv_slots=256), target)
    assert engine.tree == TreeShape(6, 2, 12) and isinstance(engine.drafter, NgramDrafter)
    assert engine.config.drafter == "ngram" and engine.config.tree == engine.tree and engine.config.device == "cpu"
    assert engine.kv.num_slots == 256
    explicit = build_engine(EngineConfig(drafter="ngram", tree="3,1,4", kv_slots=256, adaptive=True), target)
    assert explicit.tree == TreeShape(3, 1, 4) and explicit.policy is not None
    vanilla = build_engine(EngineConfig(drafter="none", kv_slots=256), target)
    assert vanilla.drafter is None and vanilla.config.drafter == "none" and vanilla.tree == FALLBACK_TREE
    # Engine around a drafter built elsewhere: the drafter's default tree by its name
    assert Engine(target, NgramDrafter(), EngineConfig(kv_slots=256)).tree == TreeShape(6, 2, 12)


def test_engine_config_checks_its_settings_before_any_model_loads(no_model_load):
    for bad in (
        dict(tree="6,x"),
        dict(tree="0,1,2"),
        dict(kv_slots=0),
        dict(prefill_tokens=0),
        dict(dtype="fp8"),
        dict(device="tpu"),
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    assert EngineConfig(tree="1,2,3,0.1").tree == EAGLE_LIKE


def test_bad_tree_and_missing_cuda_fail_the_cli_before_the_model_loads(no_model_load, no_cuda, capsys):
    assert main(["generate", "--prompt", "hi", "--tree", "6,x"]) == 2
    assert "tree must be" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_device_auto_is_cpu_without_cuda_and_cuda_without_cuda_is_an_error(no_cuda, monkeypatch):
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")

    def refuse(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr("sglang_ext.models.resolve_target", refuse)
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_target("smollm2", device="cuda:0")


def test_build_engine_loads_the_target_on_the_cpu(no_cuda, smollm2_fp32):
    engine = build_engine(EngineConfig(dtype="float32", device="auto", drafter="none", kv_slots=512))
    assert engine.config.device == "cpu" and engine.model.device.type == "cpu"
    assert engine.kv.k[0].device.type == "cpu" and engine.model.dtype == torch.float32
    ids = engine.target.encode_chat([{"role": "user", "content": "Name a colour."}])
    out = engine.generate([ids], SamplingParams(max_new_tokens=8))[0].output_ids
    ref = Engine(smollm2_fp32, None, EngineConfig(kv_slots=512)).generate([ids], SamplingParams(max_new_tokens=8))
    assert out == ref[0].output_ids


SAMPLING_FLAGS = [
    "--max-new-tokens",
    "7",
    "--temperature",
    "0.5",
    "--top-p",
    "0.9",
    "--top-k",
    "5",
    "--seed",
    "3",
    "--presence-penalty",
    "0.1",
    "--frequency-penalty",
    "0.2",
    "--repetition-penalty",
    "1.1",
    "--min-tokens",
    "2",
    "--json",
]


def test_generate_and_edge_share_the_generation_flags():
    parser = build_parser()
    gen = parser.parse_args(["generate", "--prompt", "p", "--device", "cpu", "--tree", "3", *SAMPLING_FLAGS])
    edge = parser.parse_args(["edge", "--server", "http://x", "--prompt", "p", "--device", "cpu", *SAMPLING_FLAGS])
    assert gen.json and edge.json
    assert sampling_params(gen) == sampling_params(edge)
    sp = sampling_params(gen)
    assert (sp.max_new_tokens, sp.temperature, sp.top_k, sp.seed, sp.min_tokens) == (7, 0.5, 5, 3, 2)
    assert sp.repetition_penalty == 1.1 and sp.grammar is None
    both = SAMPLING_FLAGS[:-3] + ["--regex", "[a-z]+"]  # min_tokens and a grammar do not combine
    gen = parser.parse_args(["generate", "--prompt", "p", *both])
    edge = parser.parse_args(["edge", "--server", "http://x", "--prompt", "p", *both])
    assert sampling_params(gen) == sampling_params(edge) and sampling_params(gen).grammar.kind == "regex"
    gen = parser.parse_args(["generate", "--prompt", "p", "--device", "cpu", "--tree", "3"])
    edge = parser.parse_args(["edge", "--server", "http://x", "--prompt", "p", "--device", "cpu"])
    assert engine_config(gen) == EngineConfig(device="cpu", tree=TreeShape.chain(3))
    assert engine_config(edge) == EngineConfig(device="cpu", drafter="moa-tli1")


def test_no_cuda_graphs_flag_reaches_the_engine_config():
    """Graphs are on by default (effective on a CUDA device only); --no-cuda-graphs turns them off for
    every command that builds an engine from the shared flags."""
    parser = build_parser()
    for cmd in (["generate", "--prompt", "p"], ["serve"], ["edge", "--server", "http://x", "--prompt", "p"]):
        assert engine_config(parser.parse_args(cmd + ["--device", "cpu"])).cuda_graphs
        assert not engine_config(parser.parse_args(cmd + ["--device", "cpu", "--no-cuda-graphs"])).cuda_graphs
    assert EngineConfig().cuda_graphs and not EngineConfig(cuda_graphs=False).cuda_graphs


def test_no_overlap_flag_reaches_the_engine_config():
    """The overlapped loop is on by default (effective where steps replay on an asynchronous stream: CUDA);
    --no-overlap turns it off."""
    parser = build_parser()
    for cmd in (["generate", "--prompt", "p"], ["serve"]):
        assert engine_config(parser.parse_args(cmd + ["--device", "cpu"])).overlap
        assert not engine_config(parser.parse_args(cmd + ["--device", "cpu", "--no-overlap"])).overlap
    assert EngineConfig().overlap and not EngineConfig(overlap=False).overlap


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--temperature", "0.7"], "--temperature > 0"),
        (["--repetition-penalty", "1.2"], "--repetition-penalty"),
        (["--min-tokens", "3"], "--min-tokens"),
        (["--json-schema", "{}"], "--regex / --json-schema"),
    ],
)
def test_edge_refuses_what_its_greedy_protocol_would_ignore(monkeypatch, capsys, flags, named):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("sglang_ext.models.load_target", refuse)
    assert main(["edge", "--server", "http://127.0.0.1:9", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert "moa-serve edge: error:" in err and "verifies greedily" in err and named in err
