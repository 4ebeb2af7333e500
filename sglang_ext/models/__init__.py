"""Target models: offline loading and our own Llama-family forward over a slot KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import kernels
from .kv_pool import KVPool, OutOfSlots
from .llama import ForwardOutput, LlamaModel
from .loader import (
    DEFAULT_TARGET,
    LlamaConfig,
    ModelLoadError,
    check_weights,
    load_config,
    load_packed_weights,
    load_state_dict,
    load_tokenizer,
    resolve_target,
)


@dataclass
class Target:
    model: LlamaModel
    tokenizer: object
    path: Path

    @property
    def cfg(self) -> LlamaConfig:
        return self.model.cfg

    def chat_prompt(self, messages: list[dict], continue_final: bool = False) -> str:
        """The chat template applied to messages, ending with the assistant turn header; with
        continue_final, ending inside the last (assistant) message instead, for the reply to continue it."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not continue_final, continue_final_message=continue_final
        )

    def encode(self, text: str) -> list[int]:
        # special tokens are spelled out by the chat template itself
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        return self.encode(self.chat_prompt(messages, continue_final))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


# q8: fp32 tensors (residual stream, norms, attention, K/V pool), the matmuls on 8-bit activations (wants_q8)
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "q8": torch.float32,
}
DTYPE_CHOICES = ("auto", "q8", "bfloat16", "float32")


def cpu_has_fast_bf16() -> bool:
    """Whether bf16 is faster than fp32 on this CPU: only with AMX (bf16 tile matmuls).

    NOTE: without bf16 hardware oneDNN emulates bf16 matmuls, several times slower than fp32; with
    AVX512-BF16 but no AMX, bf16 decode and bf16-autocast training are still slower than fp32
    (docs/BENCHMARKS.md, "CPU kernels")."""
    try:
        flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags


def auto_dtype(device: str = "cpu") -> torch.dtype:
    """bf16 on GPUs; on CPUs fp32 where our kernels run, else bf16 only with AMX.

    NOTE: the kernels read the GGUF's 4/8-bit blocks, fewer bytes per weight than bf16 (Q4_1: 0.6 vs 2),
    and beat bf16 on AVX512-BF16 CPUs (docs/BENCHMARKS.md, "CPU kernels"); against AMX bf16 they
    have not been measured."""
    if device != "cpu":
        return torch.bfloat16
    if kernels.AVAILABLE:
        return torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def q8_blocks_complete(cfg: LlamaConfig, packed: dict[str, tuple[str, torch.Tensor]]) -> bool:
    """Whether every layer weight and the head have GGUF blocks the q8 stack reads (Q4_1 or Q8_0, one
    kind per fused weight)."""

    def kinds(*names: str) -> set[str]:
        return {packed[n][0] if n in packed else "" for n in names}

    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    fused = [kinds(head)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        fused += [
            kinds(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
            kinds(p + "self_attn.o_proj.weight"),
            kinds(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            kinds(p + "mlp.down_proj.weight"),
        ]
    return all(len(k) == 1 and k <= {"Q4_1", "Q8_0"} for k in fused)


def wants_q8(dtype: str | torch.dtype, device: str, cfg: LlamaConfig, packed: dict) -> bool:
    """dtype q8 asked for, or 'auto' on a CPU where the q8 stack runs (AVX-512 VNNI, kernels built) and the
    target has the GGUF blocks it reads (the default target does).

    NOTE: q8 quantises each matmul's input (8 bits per 32 values, as llama.cpp does), so its greedy text
    may differ from float32's; every drafter is lossless against vanilla at either dtype. It reads the same
    bytes as float32 on our kernels with far fewer instructions (docs/BENCHMARKS.md, "Where a CPU step goes")."""
    if dtype == "q8":
        return True
    return dtype == "auto" and device == "cpu" and kernels.q8_unavailable() is None and q8_blocks_complete(cfg, packed)


def parse_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return auto_dtype(device)
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str = "auto") -> str:
    """'auto' -> 'cuda' when torch sees a CUDA GPU, else 'cpu'; 'cpu', 'cuda' and 'cuda:N' as given.
    A CUDA device without CUDA is an error here, before any weights are read."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r}: CUDA is not available here (torch.cuda.is_available() is False); "
                "use --device cpu or --device auto"
            )
        return name
    raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)} (or cuda:N)")


def load_target(
    name_or_path: str = DEFAULT_TARGET, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> Target:
    """The target model and tokenizer, its weights (and the KV pools it makes) on `device`
    ('auto': see resolve_device); dtype 'auto': q8 where wants_q8 says so, else see auto_dtype (bf16 on a GPU)."""
    device = resolve_device(device)
    path = resolve_target(name_or_path)
    cfg, state = load_config(path), load_state_dict(path)
    check_weights(cfg, state, path)
    packed = load_packed_weights(path)
    q8 = wants_q8(dtype, device, cfg, packed)
    model = LlamaModel(cfg, state, dtype=parse_dtype(dtype, device), device=device, packed=packed, q8=q8)
    return Target(model=model, tokenizer=load_tokenizer(path), path=path)


__all__ = [
    "DEFAULT_TARGET",
    "ForwardOutput",
    "KVPool",
    "LlamaConfig",
    "LlamaModel",
    "ModelLoadError",
    "OutOfSlots",
    "Target",
    "load_target",
    "parse_dtype",
    "resolve_device",
    "DEVICE_CHOICES",
    "auto_dtype",
    "cpu_has_fast_bf16",
    "DTYPE_CHOICES",
    "q8_blocks_complete",
    "wants_q8",
]
