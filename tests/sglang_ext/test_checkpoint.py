"""The checkpoint module: config.json reading, kinds, the one draft-to-target fit check (embedded
loaders and the SGLang plugin), and the one load error."""

from __future__ import annotations

import dataclasses
import json
import re
import types
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from sglang_ext.drafters import default_tree, is_suffix_corpus
from sglang_ext.models.checkpoint import (
    EAGLE3,
    INDEX,
    MOA,
    SUFFIX_CORPUS,
    CheckpointError,
    check_fits,
    checkpoint_kind,
    read_config,
    read_weights,
    save_weights,
)
from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3
from sglang_ext.models.loader import LlamaConfig
from sglang_ext.models.moa import MoAConfig, MoADraft, load_moa
from sglang_ext.settings import DRAFT_ATTENTION, reload_settings, settings
from sglang_ext.tree import TreeShape

REPO = Path(__file__).resolve().parents[2]
TARGET = tiny_config(vocab=64, hidden=32, layers=3)  # 4 heads, 2 KV heads, head_dim 8


# --- config.json ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content,phrase",
    [(None, "has no config.json"), ("{not json", "is not JSON"), ("[1, 2]", "holds a JSON list, not an object")],
)
def test_read_config_errors_name_the_path(tmp_path, content, phrase):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=phrase) as e:
        read_config(tmp_path)
    assert str(tmp_path) in str(e.value)
    assert isinstance(e.value, ValueError)  # the CLI prints ValueErrors
    assert checkpoint_kind(tmp_path) is None


def test_read_config_reads_an_object(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 8}')
    assert read_config(tmp_path) == {"architectures": ["LlamaForCausalLM"], "vocab_size": 8}
    assert checkpoint_kind(tmp_path) is None  # a target, not a drafter


@pytest.mark.parametrize(
    "name,kind",
    [
        ("smollm2-eagle3", EAGLE3),
        ("smollm2-moa-tli0", MOA),
        ("smollm2-moa-tli1", MOA),
        ("smollm2-suffix", SUFFIX_CORPUS),
    ],
)
def test_checkpoint_kind_of_the_shipped_drafters(name, kind):
    path = REPO / "drafters" / name
    assert checkpoint_kind(path) == kind
    assert checkpoint_kind(str(path)) == kind
    assert is_suffix_corpus(str(path)) == (kind == SUFFIX_CORPUS)


def test_default_tree_of_a_corpus_path_is_the_suffix_tree():
    assert default_tree(str(REPO / "drafters" / "smollm2-suffix")) == TreeShape(3, 1, 4)


# --- one fit check -------------------------------------------------------------------------------
def _moa_cfg(t=TARGET) -> MoAConfig:
    return MoAConfig.for_target(t, tli=1, draft_vocab_size=40)


# target changes -> the fields a MoA draft made for TARGET names, with (draft value, target value)
MOA_MISMATCHES = {
    "vocab": (dict(vocab_size=65), {"vocab_size": (64, 65)}),
    "hidden": (dict(hidden_size=48), {"hidden_size": (32, 48)}),
    "layers": (dict(num_layers=4), {"num_target_layers": (3, 4)}),
    "kv_heads": (dict(num_kv_heads=1), {"target_num_kv_heads": (2, 1), "num_kv_heads": (2, 1)}),
    "head_dim": (dict(head_dim=16), {"target_head_dim": (8, 16), "head_dim": (8, 16)}),
    "draft_vocab": (dict(vocab_size=32), {"vocab_size": (64, 32), "draft_vocab_size": (40, 32)}),
    "tli": (dict(num_layers=0), {"num_target_layers": (3, 0), "tli": (1, 0)}),
}


def _assert_names(message: str, fields: dict) -> None:
    for field, (mine, theirs) in fields.items():
        assert f"{field} {mine}" in message and str(theirs) in message, (field, message)
    assert message.count(";") == len(fields) - 1, message  # nothing else named


@pytest.mark.parametrize("case", sorted(MOA_MISMATCHES))
def test_moa_fit_check_names_each_field_embedded(tmp_path, case):
    change, fields = MOA_MISMATCHES[case]
    MoADraft(_moa_cfg()).save(tmp_path / "ck", dtype=torch.float32)
    other = dataclasses.replace(TARGET, **change)
    with pytest.raises(CheckpointError, match="MoA draft does not fit the target: ") as e:
        load_moa(tmp_path / "ck", other)
    _assert_names(str(e.value), fields)
    load_moa(tmp_path / "ck", TARGET)  # the target it was made for fits


def _hf_target(out: Path, t) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(t.to_hf()))
    return out


def _server_args(draft: Path, target: Path):
    return types.SimpleNamespace(
        speculative_draft_model_path=str(draft),
        model_path=str(target),
        tp_size=1,
        pp_size=1,
        dp_size=1,
        speculative_num_steps=None,
        speculative_eagle_topk=None,
        speculative_num_draft_tokens=None,
    )


@pytest.fixture
def plugin(monkeypatch):
    pytest.importorskip("sglang")
    from sglang_ext.sglang_plugin import algorithm, options

    for env in (options.TLI_ENV, options.DRAFT_ATTENTION_ENV):
        monkeypatch.delenv(env, raising=False)
    return algorithm


@pytest.mark.parametrize("case", sorted(MOA_MISMATCHES))
def test_moa_fit_check_names_each_field_plugin(tmp_path, plugin, case):
    change, fields = MOA_MISMATCHES[case]
    MoADraft(_moa_cfg()).save(tmp_path / "ck", dtype=torch.float32)
    other = _hf_target(tmp_path / "target", dataclasses.replace(TARGET, **change))
    with pytest.raises(CheckpointError, match="MoA draft does not fit --model-path: ") as e:
        plugin.validate_moa_server_args(_server_args(tmp_path / "ck", other))
    _assert_names(str(e.value), fields)
    plugin.validate_moa_server_args(_server_args(tmp_path / "ck", _hf_target(tmp_path / "same", TARGET)))


def test_plugin_checkpoint_errors_name_the_flag(tmp_path, plugin):
    target = _hf_target(tmp_path / "target", TARGET)
    with pytest.raises(CheckpointError, match="--speculative-draft-model-path .*has no config.json"):
        plugin.validate_moa_server_args(_server_args(tmp_path / "none", target))
    with pytest.raises(CheckpointError, match="use --speculative-algorithm EAGLE3"):
        plugin.validate_moa_server_args(_server_args(REPO / "drafters" / "smollm2-eagle3", target))
    MoADraft(_moa_cfg()).save(tmp_path / "ck", dtype=torch.float32)
    (tmp_path / "ck" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        plugin.validate_moa_server_args(_server_args(tmp_path / "ck", target))
    with pytest.raises(plugin.MoAServerArgsError, match="needs --speculative-draft-model-path"):
        plugin.validate_moa_server_args(_server_args("", target))


@pytest.mark.parametrize("value", DRAFT_ATTENTION)
def test_every_draft_attention_value_passes_the_server_args_check_plugin(tmp_path, plugin, monkeypatch, value):
    """One list of values (settings.DRAFT_ATTENTION): each passes SGLang's server-args hook and resolves
    to a backend the draft passes have; another value is refused there, naming the variable."""
    from sglang_ext.sglang_plugin.options import BACKENDS
    from sglang_ext.sglang_plugin.tree_attention import resolve_backend_name

    MoADraft(_moa_cfg()).save(tmp_path / "ck", dtype=torch.float32)
    args = _server_args(tmp_path / "ck", _hf_target(tmp_path / "target", TARGET))
    monkeypatch.setenv("MOA_SGLANG_DRAFT_ATTENTION", value)
    reload_settings()
    plugin.validate_moa_server_args(args)
    assert resolve_backend_name("cpu") in BACKENDS and resolve_backend_name("cuda") in BACKENDS
    monkeypatch.setenv("MOA_SGLANG_DRAFT_ATTENTION", "flash")
    settings.cache_clear()  # (parsed at the next use: in the hook)
    with pytest.raises(plugin.MoAServerArgsError, match="MOA_SGLANG_DRAFT_ATTENTION"):
        plugin.validate_moa_server_args(args)


def test_the_docs_list_the_draft_attention_values():
    row = next(l for l in (REPO / "docs" / "SGLANG.md").read_text().splitlines() if "`MOA_SGLANG_DRAFT_ATTENTION`" in l)
    listed = re.findall(r"`([a-z]+)`", row.split("|")[3])
    assert sorted(set(listed)) == sorted(DRAFT_ATTENTION), row


# EAGLE-3 (for a 6-layer target: aux layers 1, 2, 2; draft vocab 48)
EAGLE3_TARGET = tiny_config(vocab=64, hidden=32, layers=6)
EAGLE3_MISMATCHES = {
    "vocab": (dict(vocab_size=65), {"vocab_size": (64, 65)}),
    "hidden": (dict(hidden_size=48), {"hidden_size": (32, 48), "target_hidden_size": (32, 48)}),
    "aux_layers": (dict(num_layers=2), {"aux_layers": ([1, 2, 2], 2)}),
    "draft_vocab": (dict(vocab_size=40), {"vocab_size": (64, 40), "draft_vocab_size": (48, 40)}),
}


@pytest.mark.parametrize("case", sorted(EAGLE3_MISMATCHES))
def test_eagle3_fit_check_names_each_field(tmp_path, case):
    change, fields = EAGLE3_MISMATCHES[case]
    Eagle3Draft(Eagle3Config.for_target(EAGLE3_TARGET, 48)).save(tmp_path / "ck", dtype=torch.float32)
    with pytest.raises(CheckpointError, match="EAGLE-3 draft does not fit the target: ") as e:
        load_eagle3(tmp_path / "ck", dataclasses.replace(EAGLE3_TARGET, **change))
    _assert_names(str(e.value), fields)
    load_eagle3(tmp_path / "ck", EAGLE3_TARGET)


def test_fit_check_names_the_target():
    with pytest.raises(CheckpointError, match="does not fit the target model: vocab_size 64 != target's vocab_size 65"):
        check_fits(_moa_cfg(), dataclasses.replace(TARGET, vocab_size=65), "the target model")


# --- one load error ------------------------------------------------------------------------------
@pytest.fixture(params=["moa", "eagle3"])
def saved(request, tmp_path):
    """(checkpoint dir, loader) of a small saved draft of each kind, in two shards."""
    if request.param == "moa":
        draft, loader = MoADraft(_moa_cfg()), lambda p: load_moa(p, TARGET)
    else:
        draft, loader = Eagle3Draft(Eagle3Config.for_target(EAGLE3_TARGET, 48)), lambda p: load_eagle3(p, EAGLE3_TARGET)
    draft.save(tmp_path / "ck", dtype=torch.float32)
    state = read_weights(tmp_path / "ck")
    save_weights(state, tmp_path / "ck", max_shard_bytes=sum(t.numel() * 4 for t in state.values()) // 2)
    assert (tmp_path / "ck" / INDEX).is_file()
    loader(tmp_path / "ck")
    return tmp_path / "ck", loader


def _rewrite(ckpt: Path, edit) -> None:
    state = read_weights(ckpt)
    edit(state)
    save_weights(state, ckpt)


def test_missing_unexpected_and_misshaped_tensors_are_named(saved):
    ckpt, loader = saved
    name = next(k for k in read_weights(ckpt) if k.endswith("q_proj.weight"))
    _rewrite(ckpt, lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=f"missing weights \\['{name}'\\]"):
        loader(ckpt)
    _rewrite(ckpt, lambda s: s.update({name: torch.zeros(3, 5), "self_attention.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError) as e:
        loader(ckpt)
    assert "unexpected weights ['self_attention.extra.weight']" in str(e.value)
    assert f"{name} [3, 5] != [" in str(e.value)


def test_missing_or_unreadable_weights(saved):
    ckpt, loader = saved
    shards = sorted(ckpt.glob("model-*.safetensors"))
    shards[0].write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot be read"):
        loader(ckpt)
    shards[0].unlink()
    with pytest.raises(CheckpointError, match="cannot be read"):
        loader(ckpt)
    (ckpt / INDEX).write_text("{")
    with pytest.raises(CheckpointError, match="is not a safetensors index"):
        loader(ckpt)
    for f in [*ckpt.glob("*.safetensors"), ckpt / INDEX]:
        f.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        loader(ckpt)


def test_bad_config_values_are_checkpoint_errors(tmp_path):
    MoADraft(_moa_cfg()).save(tmp_path / "moa", dtype=torch.float32)
    cfg = read_config(tmp_path / "moa")
    (tmp_path / "moa" / "config.json").write_text(json.dumps(cfg | {"tli": "one"}))
    with pytest.raises(CheckpointError, match="bad MoA config"):
        load_moa(tmp_path / "moa")
    Eagle3Draft(Eagle3Config.for_target(EAGLE3_TARGET, 48)).save(tmp_path / "e3", dtype=torch.float32)
    cfg = read_config(tmp_path / "e3")
    del cfg["hidden_size"]
    (tmp_path / "e3" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="bad EAGLE-3 config: KeyError 'hidden_size'"):
        load_eagle3(tmp_path / "e3")


def test_shipped_heads_load_for_their_target_shape():
    """The shipped checkpoints pass the fit check for SmolLM2-135M's shape (no weights of the target needed)."""
    smol = dataclasses.replace(
        tiny_config(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3), head_dim=64, intermediate_size=1536
    )
    assert load_eagle3(REPO / "drafters" / "smollm2-eagle3", smol).cfg.draft_vocab_size == 8192
    assert load_moa(REPO / "drafters" / "smollm2-moa-tli1", smol).cfg.tli == 1


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_config(),
        tiny_config(vocab=64, layers=6, bias=True),
        dataclasses.replace(
            tiny_config(),
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            eos_token_ids=(2, 7),
            tie_word_embeddings=True,
        ),
    ],
    ids=["tiny", "bias", "llama3-rope"],
)
def test_llama_config_round_trips_through_a_hf_config(cfg, tmp_path):
    """LlamaConfig.to_hf is the one writer of a target's config.json (the GPU job's smoke target, tests'
    targets): what it writes, from_hf and transformers read back as the same model."""
    from transformers import LlamaConfig as HFLlamaConfig

    assert LlamaConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
    hf = HFLlamaConfig(**cfg.to_hf())
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim) == (
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    assert LlamaConfig.from_hf(hf.to_dict()) == cfg
