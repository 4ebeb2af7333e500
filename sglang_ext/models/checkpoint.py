"""Checkpoint directories: the one place that reads config.json, tells checkpoint kinds apart, checks
that a draft fits its target, and reads and writes the weights.

    config.json                                         read_config: a JSON object, else CheckpointError
    model.safetensors                                   when the weights fit in one shard
    model-00001-of-00002.safetensors ...                otherwise, each at most max_shard_bytes,
    model.safetensors.index.json                        {"metadata": {"total_size"}, "weight_map": {name: file}}
    pytorch_model.bin                                   read when there are no safetensors (SpecForge)

Kinds (checkpoint_kind): "eagle3" (architectures name an Eagle3 model), "moa" (["MoADraftModel"]),
"medusa" (["MedusaHeads"]), "suffix-corpus" (`kind` written by `moa-serve build-corpus`). Every way a
checkpoint cannot be loaded (no or malformed config.json, no weights, unexpected / missing / mis-shaped tensors, a draft
that does not fit its target) is one CheckpointError, a ValueError, whose message names the path or
the field; the EAGLE-3, MoA and Medusa loaders and the SGLang plugin all raise it.

Shards keep every file of a shipped head under the size a GPU job can send back (16 MiB) and are
what SGLang and transformers read. Reading follows the index when there is one, so stale files
beside it are never mixed in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
MAX_SHARD_BYTES = 15 * 2**20  # under the 16 MiB a GPU job may return per file
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
MOA_ARCH = "MoADraftModel"
MEDUSA_ARCH = "MedusaHeads"
EAGLE3, MOA, MEDUSA, SUFFIX_CORPUS = "eagle3", "moa", "medusa", "suffix-corpus"


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded (missing or malformed, or it does not fit the target)."""


# --- config.json ---------------------------------------------------------------------------------
def has_config(path: str | Path) -> bool:
    return (Path(path).expanduser() / CONFIG).is_file()


def read_config(path: str | Path) -> dict:
    """config.json of the checkpoint directory `path` as a dict."""
    f = Path(path).expanduser() / CONFIG
    if not f.is_file():
        raise CheckpointError(f"{f.parent} has no {CONFIG}")
    try:
        raw = json.loads(f.read_text())
    except OSError as e:
        raise CheckpointError(f"{f} cannot be read ({e})") from e
    except ValueError as e:  # bad JSON or bad UTF-8
        raise CheckpointError(f"{f} is not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{f} holds a JSON {type(raw).__name__}, not an object")
    return raw


def config_kind(cfg: dict) -> str | None:
    """EAGLE3, MOA, MEDUSA or SUFFIX_CORPUS for a config.json's contents; None for anything else."""
    if cfg.get("kind") == SUFFIX_CORPUS:
        return SUFFIX_CORPUS
    archs = cfg.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if MOA_ARCH in archs:
        return MOA
    if MEDUSA_ARCH in archs:
        return MEDUSA
    if any("Eagle3" in a for a in archs):
        return EAGLE3
    return None


def checkpoint_kind(path: str | Path) -> str | None:
    """The kind of the checkpoint directory `path`; None when it is not one (or has no readable config)."""
    try:
        return config_kind(read_config(path))
    except CheckpointError:
        return None


# --- does a draft fit its target -------------------------------------------------------------------
def fit_problems(draft, target) -> list[str]:
    """Every way `draft` (an Eagle3Config, MoAConfig or MedusaConfig, told apart by `kind`) does not fit `target`
    (a LlamaConfig), each naming the draft's field and value and the target's field and value."""
    t = target
    same = [  # (draft field, its value, target field, its value)
        ("vocab_size", draft.vocab_size, "vocab_size", t.vocab_size),
        ("hidden_size", draft.hidden_size, "hidden_size", t.hidden_size),
    ]
    if draft.kind == EAGLE3:  # fc reads the target's hidden states of the aux layers
        same.append(("target_hidden_size", draft.target_hidden_size, "hidden_size", t.hidden_size))
    if draft.kind == MOA:
        same += [
            # LSA reads K|V of every target layer, per KV head
            ("num_target_layers", draft.num_target_layers, "num_layers", t.num_layers),
            ("target_num_kv_heads", draft.target_num_kv_heads, "num_kv_heads", t.num_kv_heads),
            ("target_head_dim", draft.target_head_dim, "head_dim", t.head_dim),
            # SGLang budgets the draft KV pool (SA, CA) with the target's per-layer KV size
            ("num_kv_heads", draft.num_kv_heads, "num_kv_heads", t.num_kv_heads),
            ("head_dim", draft.head_dim, "head_dim", t.head_dim),
        ]
    problems = [f"{name} {d} != target's {tname} {tv}" for name, d, tname, tv in same if d != tv]
    if draft.draft_vocab_size > t.vocab_size:
        problems.append(f"draft_vocab_size {draft.draft_vocab_size} > target's vocab_size {t.vocab_size}")
    if draft.kind == EAGLE3 and any(not 0 <= l < t.num_layers for l in draft.aux_layers):
        problems.append(f"aux_layers {list(draft.aux_layers)} outside target's num_layers {t.num_layers}")
    if draft.kind == MOA and not 0 <= draft.tli <= t.num_layers:
        problems.append(f"tli {draft.tli} outside [0, target's num_layers {t.num_layers}]")
    return problems


def check_fits(draft, target, target_name: str = "the target") -> None:
    """CheckpointError listing every mismatch of `draft` against `target` (see fit_problems)."""
    problems = fit_problems(draft, target)
    if problems:
        what = {EAGLE3: "EAGLE-3", MOA: "MoA", MEDUSA: "Medusa"}[draft.kind]
        raise CheckpointError(f"{what} draft does not fit {target_name}: " + "; ".join(problems))


# --- weights ---------------------------------------------------------------------------------------
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
    d = Path(ckpt_dir).expanduser()
    if (d / INDEX).is_file():
        try:
            files = set(json.loads((d / INDEX).read_text())["weight_map"].values())
            return [d / f for f in sorted(files)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{d / INDEX} is not a safetensors index ({type(e).__name__}: {e})") from e
    return sorted(d.glob("*.safetensors"))


def read_weights(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: its safetensors files, else pytorch_model.bin."""
    d = Path(ckpt_dir).expanduser()
    files = weight_files(d)
    if not files and (d / BIN).is_file():
        files = [d / BIN]
    if not files:
        raise CheckpointError(f"no model.safetensors or {BIN} in {d}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(torch.load(f, map_location="cpu", weights_only=True) if f.name == BIN else load_file(str(f)))
        except (OSError, RuntimeError, SafetensorError) as e:  # a missing shard, a truncated or foreign file
            raise CheckpointError(f"{f} cannot be read ({type(e).__name__}: {e})") from e
    return state


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], ckpt: str | Path) -> None:
    """Copy `state` into `model`; CheckpointError naming every missing, unexpected or mis-shaped tensor."""
    own = model.state_dict()
    missing = sorted(own.keys() - state.keys())
    unexpected = sorted(state.keys() - own.keys())
    shapes = [
        f"{k} {list(state[k].shape)} != {list(own[k].shape)}"
        for k in sorted(own.keys() & state.keys())
        if state[k].shape != own[k].shape
    ]
    problems = [
        f"{what} {names}"
        for what, names in (("missing weights", missing), ("unexpected weights", unexpected), ("shapes", shapes))
        if names
    ]
    if problems:
        raise CheckpointError(f"{ckpt}: " + "; ".join(problems))
    model.load_state_dict(state)


__all__ = [
    "CONFIG",
    "EAGLE3",
    "EAGLE3_ARCH",
    "INDEX",
    "MAX_SHARD_BYTES",
    "MEDUSA",
    "MEDUSA_ARCH",
    "MOA",
    "MOA_ARCH",
    "SUFFIX_CORPUS",
    "CheckpointError",
    "check_fits",
    "checkpoint_kind",
    "config_kind",
    "fit_problems",
    "has_config",
    "load_state",
    "read_config",
    "read_weights",
    "save_weights",
    "weight_files",
]
