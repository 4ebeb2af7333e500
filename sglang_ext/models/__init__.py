"""Target models: offline loading and our own Llama-family forward over a slot KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .kv_pool import KVPool, OutOfSlots
from .llama import ForwardOutput, LlamaModel
from .loader import DEFAULT_TARGET, LlamaConfig, ModelLoadError, load_config, load_state_dict, load_tokenizer, resolve_target


@dataclass
class Target:
    model: LlamaModel
    tokenizer: object
    path: Path

    @property
    def cfg(self) -> LlamaConfig:
        return self.model.cfg


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: str | torch.dtype = "float32", device: str = "cpu") -> Target:
    path = resolve_target(name_or_path)
    model = LlamaModel(load_config(path), load_state_dict(path), dtype=parse_dtype(dtype), device=device)
    return Target(model=model, tokenizer=load_tokenizer(path), path=path)


__all__ = ["DEFAULT_TARGET", "ForwardOutput", "KVPool", "LlamaConfig", "LlamaModel", "ModelLoadError", "OutOfSlots", "Target", "load_target", "parse_dtype"]
