"""Drafters behind one interface (base.Drafter), built by name from one registry."""

from __future__ import annotations

from typing import Callable

from .base import Drafter, DrafterError, DraftInput, TargetCapture
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

# name -> factory(target_model) ; EAGLE-3 and MoA register here too
_REGISTRY: dict[str, Callable[..., Drafter]] = {
    "ngram": lambda target: NgramDrafter(),
    "suffix": lambda target, path=None: _suffix().SuffixDrafter.from_target(target, path),
    "draft-model": lambda target: DraftModelDrafter.self_draft(target.model),
    "eagle3": lambda target, path=None: _eagle3().Eagle3Drafter.from_target(target, path),
    "moa": lambda target, path=None: _moa().MoADrafter.from_target(target, path, name="moa"),
    "moa-tli0": lambda target: _moa().MoADrafter.from_target(target, name="moa-tli0"),
    "moa-tli1": lambda target: _moa().MoADrafter.from_target(target, name="moa-tli1"),
}


def _eagle3():
    from . import eagle3

    return eagle3


def _suffix():
    from . import suffix

    return suffix


def _moa():
    from . import moa

    return moa


def register_drafter(name: str, factory: Callable[..., Drafter]) -> None:
    _REGISTRY[name] = factory


def _config(path: str) -> dict:
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def is_suffix_corpus(path: str) -> bool:
    """A directory written by `moa-serve build-corpus`."""
    return _config(path).get("kind") == "suffix-corpus"


def _is_eagle3_checkpoint(path: str) -> bool:
    return any("Eagle3" in a for a in _config(path).get("architectures", []))


def available_drafters() -> list[str]:
    return ["none", "auto", *sorted(_REGISTRY)]


def resolve_drafter(name: str | None, target) -> str | None:
    """'auto' -> the best training-free drafter for `target`: the suffix drafter when a corpus of
    the target's answers is shipped for it (drafters/, SmolLM2), else n-gram. Other names unchanged."""
    if name != "auto":
        return name
    suffix = _suffix()
    try:
        suffix.shipped_corpus(target)
    except suffix.CorpusError:
        return "ngram"
    return "suffix"


def make_drafter(name: str | None, target) -> Drafter | None:
    """A drafter for `target` by registry name ('auto': see resolve_drafter);
    'none' (or None) means vanilla decoding."""
    name = resolve_drafter(name, target)
    if name in (None, "none", "vanilla"):
        return None
    if name not in _REGISTRY and is_suffix_corpus(name):
        return _REGISTRY["suffix"](target, name)  # --drafter PATH to a corpus from `moa-serve build-corpus`
    if name not in _REGISTRY and _is_eagle3_checkpoint(name):
        return _REGISTRY["eagle3"](target, name)  # --drafter PATH to an EAGLE-3 checkpoint directory
    if name not in _REGISTRY:
        from ..models.moa import is_moa_checkpoint

        if is_moa_checkpoint(name):
            return _REGISTRY["moa"](target, name)  # --drafter PATH to a MoA checkpoint directory
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return _REGISTRY[name](target)


__all__ = [
    "DraftInput",
    "Drafter",
    "DrafterError",
    "DraftModelDrafter",
    "NgramDrafter",
    "TargetCapture",
    "available_drafters",
    "is_suffix_corpus",
    "make_drafter",
    "register_drafter",
    "resolve_drafter",
]
