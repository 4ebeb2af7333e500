"""Random-weight targets and the configs they come in: the one home of what the training smoke job
(`moa-serve train job --smoke`), the GPU job's smoke run, the step-cost proxy and the tests build instead of a
real checkpoint.

    smoke_config(vocab)    SmolLM2's family (tied embeddings, GQA) at a fraction of its size
    smollm2_config()       SmolLM2-135M's shape (random targets of the real size: GPU checks, the step-cost proxy)
    random_state(cfg)      weights in HF naming: embeddings N(0, 1), projections N(0, gain^2 / fan_in), norms 1
    random_target(cfg)     a LlamaModel of them; save_random_target(dir, cfg): an HF directory of them
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .loader import LlamaConfig


def smoke_config(vocab_size: int) -> LlamaConfig:
    """SmolLM2's family (tied embeddings, GQA) at a fraction of its size, with the data's vocab."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position=2048,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=(2,),
    )


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M's shape (random-weight targets of the real size: GPU checks, the step-cost proxy)."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        eos_token_ids=(2,),
    )


def random_state(cfg: LlamaConfig, seed: int = 0, gain: float = 1.0) -> dict[str, torch.Tensor]:
    """Random weights of cfg's shape in HF naming, drawn in a fixed order from one generator: the embeddings
    (and an untied lm_head) N(0, 1); each layer's projections N(0, (gain / sqrt(fan_in))^2), then its q/k/v
    biases N(0, 0.01) when the config has them; norms 1. gain > 1 peaks the next-token distributions."""
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    shapes = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    state = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g)}
    state["model.norm.weight"] = torch.ones(h)
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = torch.randn(cfg.vocab_size, h, generator=g)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            state[p + name + ".weight"] = torch.randn(*shape, generator=g) * (gain / shape[1] ** 0.5)
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
        if cfg.attention_bias:
            for n, width in (("q", q), ("k", kv), ("v", kv)):
                state[p + f"self_attn.{n}_proj.bias"] = torch.randn(width, generator=g) * 0.1
    return state


def random_target(
    cfg: LlamaConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, gain=1.0
):
    """A LlamaModel of cfg's shape with random_state's weights."""
    from .llama import LlamaModel

    return LlamaModel(cfg, random_state(cfg, seed, gain), dtype=dtype, device=device)


def save_random_target(out: Path, cfg: LlamaConfig, seed: int = 0) -> Path:
    """random_state's weights as an HF directory (config.json + model.safetensors, no tokenizer); kept when the
    directory already holds a config."""
    from safetensors.torch import save_file

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file(random_state(cfg, seed), out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    return out
