"""A user's own target: local HF Llama, Qwen2 and Mistral directories (small random checkpoints written here by
transformers, in sharded safetensors, with SmolLM2's tokenizer) load with logits equal to transformers' own
forward and train heads end to end; what our forward cannot run is a clear error, one line at the command line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from moa_serve.entrypoints.cli import main as cli_main
from sglang_ext.attention import causal_mask, plan_attention
from sglang_ext.models import ModelLoadError, load_target
from sglang_ext.models.checkpoint import INDEX
from sglang_ext.models.eagle3 import load_eagle3
from sglang_ext.models.loader import resolve_target
from sglang_ext.models.moa import load_moa

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),  # q/k/v biases, tied head
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def write_target(arch: str, d, seed: int = 0, **overrides):
    """A random 3-layer model of arch with SmolLM2's vocab and tokenizer, in shards of <= 300 KB (+ index)."""
    config_cls, model_cls, extra = ARCHS[arch]
    cfg = config_cls(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **(extra | overrides),
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # every weight random, biases and norms included (init leaves them 0 / 1)
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name or "bias" in name else 0.0))
    model.save_pretrained(d, max_shard_size="300KB")
    for f in TOKENIZER_FILES:
        if (resolve_target("smollm2") / f).is_file():
            shutil.copy(resolve_target("smollm2") / f, d / f)
    return model


def _our_logits(model, ids: list[int]) -> torch.Tensor:
    kv = model.new_kv_pool(len(ids) + 1)
    s = kv.alloc(len(ids))
    plan = plan_attention([s], [causal_mask(len(ids), 0)])
    out = model.forward(torch.tensor(ids), torch.arange(len(ids)), s, plan, kv)
    return model.logits(out.hidden).float()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_local_target_loads_with_transformers_logits(tmp_path, arch):
    hf = write_target(arch, tmp_path)
    assert (tmp_path / INDEX).is_file() and len(list(tmp_path.glob("model-*.safetensors"))) > 1
    target = load_target(str(tmp_path), dtype="float32")
    assert target.cfg.attention_bias == (arch == "qwen2")
    ids = target.encode_chat([{"role": "user", "content": "Name three primary colors."}])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(_our_logits(target.model, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_heads_train_on_a_local_target(tmp_path, arch):
    """`moa-serve train job --target DIR` on conversations: EAGLE-3 and MoA TLI=1 (which runs the target's last
    layer, biases included) train, export and load against that target."""
    write_target(arch, tmp_path / "target")
    convs = tmp_path / "convs.jsonl"
    turns = [("What is 7 times 8?", "It is 56."), ("Name a color.", "Blue is a color, and so is red.")]
    convs.write_text(
        "".join(
            json.dumps(
                {"id": i, "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            )
            + "\n"
            for i, (q, a) in enumerate(turns * 3)
        )
    )
    out = tmp_path / "run"
    args = ["train", "job", "--target", str(tmp_path / "target"), "--data", str(convs), "--out", str(out)]
    args += ["--heads", "eagle3,moa-tli1", "--max-steps", "2", "--tokens-per-batch", "256", "--max-len", "64"]
    # the whole vocab: a random target's next token is anywhere in it
    assert cli_main(args + ["--draft-vocab-size", "0", "--threads", "1", "--target-dtype", "float32"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["heads"] == ["eagle3", "moa-tli1"]
    assert summary["final_train"]["eagle3/loss"] > 0 and summary["final_train"]["moa-tli1/kl"] > 0
    cfg = load_target(str(tmp_path / "target"), dtype="float32").cfg
    assert load_eagle3(out / "heads" / "eagle3", cfg).cfg.draft_vocab_size == cfg.vocab_size
    assert load_moa(out / "heads" / "moa-tli1", cfg).cfg.tli == 1


@pytest.mark.parametrize(
    "arch,overrides,match",
    [
        (
            "mistral",
            {"sliding_window": 64},
            "sliding-window attention .sliding_window=64 < max_position_embeddings=512",
        ),
        ("llama", {"attention_bias": True}, "weights this forward does not use: model.layers.0.self_attn.o_proj.bias"),
        ("llama", {"mlp_bias": True}, "weights this forward does not use: model.layers.0.mlp.down_proj.bias"),
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "RoPE scaling 'yarn' is not supported"),
    ],
)
def test_what_our_forward_cannot_run_is_refused(tmp_path, arch, overrides, match):
    write_target(arch, tmp_path, **overrides)
    with pytest.raises(ModelLoadError, match=match):
        load_target(str(tmp_path))


def test_an_unsupported_architecture_is_one_line(tmp_path, capsys):
    write_target("llama", tmp_path)
    capsys.readouterr()  # (transformers' progress bar)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "gemma"}))
    args = ["train", "eagle3", "--target", str(tmp_path), "--data", "sharegpt", "--out", str(tmp_path / "run")]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"moa-serve train eagle3: error: unsupported model_type 'gemma' in {tmp_path}; supported: llama, "
        "qwen2, mistral"
    )


def test_load_tokenizer_is_autotokenizers_tokenizer_without_its_imports(tmp_path):
    """The shipped tokenizer (config naming the tokenizers-backed base class) loads as AutoTokenizer loads it:
    same class, ids, chat template and text, and a fresh process does so without importing transformers' model
    configs or torchvision. A config naming another class still goes through AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from sglang_ext.models.loader import load_tokenizer

    src = resolve_target("smollm2")
    ours, auto = load_tokenizer(src), AutoTokenizer.from_pretrained(src)
    assert type(ours) is type(auto)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hé <b>you</b> 😀\n\n  x"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(
        chat, add_generation_prompt=True
    )
    text = "Hello <|im_end|> wörld\n\n bar 😀"
    assert ours.encode(text) == auto.encode(text) and ours.decode(ours.encode(text)) == text
    assert (ours.eos_token_id, ours.pad_token_id, ours.all_special_ids) == (
        auto.eos_token_id,
        auto.pad_token_id,
        auto.all_special_ids,
    )
    # modules loaded from a file: transformers 5.19 also registers file-less aliases of its image processors
    # (transformers.models.*.image_processing_*_fast) when it starts, which import nothing
    probe = (
        "import sys; from sglang_ext.models.loader import load_tokenizer, resolve_target; "
        "load_tokenizer(resolve_target('smollm2')); "
        "print(sorted(m for m, mod in sys.modules.items() if m == 'torchvision' or "
        "(m.startswith('transformers.models.') and getattr(mod, '__file__', None))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout

    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, tmp_path / f)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"}))
    assert type(load_tokenizer(tmp_path)) is type(AutoTokenizer.from_pretrained(tmp_path))
