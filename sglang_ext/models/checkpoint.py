"""Draft checkpoint files: safetensors weights, one file or Hugging Face-style shards.

    model.safetensors                                   when the weights fit in one shard
    model-00001-of-00002.safetensors ...                otherwise, each at most max_shard_bytes,
    model.safetensors.index.json                        {"metadata": {"total_size"}, "weight_map": {name: file}}

Shards keep every file of a shipped head under the size a GPU job can send back (16 MiB) and are
what SGLang and transformers read. Reading follows the index when there is one, so stale files
beside it are never mixed in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 15 * 2**20  # under the 16 MiB a GPU job may return per file


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors, each at most max_bytes (a larger tensor gets a shard alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        if shards[-1] and size + _nbytes(t) > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    return shards


def save_weights(
    state: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Write state as model.safetensors or as shards + index; returns the file names written.
    Earlier weight files in out_dir are removed first, so a directory never holds two versions."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX]:
        old.unlink(missing_ok=True)
    shards = _split({k: v.contiguous() for k, v in state.items()}, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        tmp = out / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(t) for t in state.values())},
            "weight_map": {k: n for n, s in zip(names, shards) for k in s},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def weight_files(ckpt_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every *.safetensors."""
    d = Path(ckpt_dir)
    if (d / INDEX).is_file():
        return [d / f for f in sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))]
    return sorted(d.glob("*.safetensors"))


def read_weights(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(ckpt_dir):
        state.update(load_file(str(f)))
    return state
