"""Drafters behind one interface (base.Drafter), built by name from one registry.

Each registry entry is a DrafterSpec: the factory that builds the drafter for a target, and the tree
shape it drafts best with (default_tree reads it; the numbers are measured, docs/BENCHMARKS.md). The
checkpoints and corpora shipped per target are one table beside it (shipped.py: SHIPPED, shipped_path).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..models.checkpoint import EAGLE3, MEDUSA, MOA, SUFFIX_CORPUS, CheckpointError, checkpoint_kind
from ..tree import TreeShape
from .base import Drafter, DrafterError, DraftInput, TargetCapture, require_drafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter
from .shipped import SHIPPED, shipped_path

# the tree of a drafter without a tuned one (registered without a tree, or not in the registry)
FALLBACK_TREE = TreeShape(6, 4, 24)

# EAGLE-3 and MoA share one tree budget, so their numbers compare. On a CPU a verify row costs a fraction
# of a decode and each draft step a head forward, so one draft step with two candidates is fastest with
# the shipped heads, and nodes of draft probability < 0.1 are rarely accepted: not worth a verify row
# (docs/BENCHMARKS.md, "Tree shapes"). On a GPU a tree verify costs about a decode: deeper trees there.
EAGLE_LIKE_TREE = TreeShape(1, 2, 3, min_prob=0.1)

# suffix: a 3-token chain: on a CPU each verify row costs ~1/4 of a decode, and the 3-chain beats longer
# chains and trees over the six eval sets (docs/BENCHMARKS.md, "Tree shapes")
SUFFIX_TREE = TreeShape(3, 1, 4)

# medusa: one head forward drafts every depth (no draft step per level, unlike EAGLE-3 / MoA), so depth
# costs only verify rows; heads 2-4 of the CPU-trained heads are rarely right (drafters/smollm2-medusa),
# so three levels, two candidates each, six nodes, and min_prob 0.1 as for the other neural drafters
MEDUSA_TREE = TreeShape(3, 2, 6, min_prob=0.1)


@dataclass(frozen=True)
class DrafterSpec:
    """A registry entry: factory(target[, path]) -> Drafter, and the drafter's default tree shape."""

    factory: Callable[..., Drafter]
    default_tree: TreeShape = FALLBACK_TREE


def _eagle3():
    from . import eagle3

    return eagle3


def _suffix():
    from . import suffix

    return suffix


def _lookahead():
    from . import lookahead

    return lookahead


def _moa():
    from . import moa

    return moa


def _medusa():
    from . import medusa

    return medusa


# name -> DrafterSpec; a factory taking `path` also builds from a checkpoint / corpus directory
_REGISTRY: dict[str, DrafterSpec] = {
    "ngram": DrafterSpec(lambda target: NgramDrafter(), TreeShape(6, 2, 12)),
    # lookahead-wW-nN names a window and n-gram size; its default tree is a chain of its window
    "lookahead": DrafterSpec(lambda target, *window_ngram: _lookahead().LookaheadDrafter(*window_ngram), SUFFIX_TREE),
    "suffix": DrafterSpec(lambda target, path=None: _suffix().SuffixDrafter.from_target(target, path), SUFFIX_TREE),
    "draft-model": DrafterSpec(lambda target: DraftModelDrafter.self_draft(target.model), TreeShape(3, 1, 4)),
    "eagle3": DrafterSpec(lambda target, path=None: _eagle3().Eagle3Drafter.from_target(target, path), EAGLE_LIKE_TREE),
    "moa": DrafterSpec(
        lambda target, path=None: _moa().MoADrafter.from_target(target, path, name="moa"), EAGLE_LIKE_TREE
    ),
    "moa-tli0": DrafterSpec(lambda target: _moa().MoADrafter.from_target(target, name="moa-tli0"), EAGLE_LIKE_TREE),
    "moa-tli1": DrafterSpec(lambda target: _moa().MoADrafter.from_target(target, name="moa-tli1"), EAGLE_LIKE_TREE),
    "medusa": DrafterSpec(lambda target, path=None: _medusa().MedusaDrafter.from_target(target, path), MEDUSA_TREE),
}


def register_drafter(name: str, factory: Callable[..., Drafter], default_tree: TreeShape | None = None) -> None:
    """Add (or replace) a drafter; without a default tree it drafts with FALLBACK_TREE unless told otherwise."""
    _REGISTRY[name] = DrafterSpec(factory, default_tree or FALLBACK_TREE)


def _merged():
    from . import merged

    return merged


def merge_members(name: str | None) -> list[str] | None:
    """'suffix+eagle3' -> ['suffix', 'eagle3'] (a merged tree of several drafters: drafters/merged.py);
    None for a name without '+' (or a directory that has one). Every member must be a drafter name or
    directory this registry knows (not 'none' or 'auto'), each at most once."""
    sep = _merged().SEPARATOR
    if not name or sep not in name or name in _REGISTRY or Path(name).exists():
        return None
    parts = name.split(sep)
    bad = [p for p in parts if p in ("", "none", "auto", "vanilla") or drafter_kind(p) is None]
    if bad:
        raise ValueError(
            f"bad merged drafter {name!r}: {bad[0]!r} is not a drafter; available: {', '.join(available_drafters())}"
        )
    if len(set(parts)) != len(parts):
        raise ValueError(f"bad merged drafter {name!r}: a drafter named twice")
    return parts


def is_suffix_corpus(path: str) -> bool:
    """A directory written by `moa-serve build-corpus`."""
    return checkpoint_kind(path) == SUFFIX_CORPUS


def drafter_kind(name: str | None) -> str | None:
    """The registry entry a drafter name stands for: the name itself, or for a directory the kind of
    what it holds (a suffix corpus -> 'suffix', an EAGLE-3 / MoA checkpoint -> 'eagle3' / 'moa');
    None when it is neither."""
    if name in _REGISTRY:
        return name
    if not name:
        return None
    if _lookahead().parse_spec(name) is not None:
        return "lookahead"  # lookahead-wW-nN
    # --drafter PATH: a corpus from `moa-serve build-corpus`, an EAGLE-3 or a MoA checkpoint directory
    return {SUFFIX_CORPUS: "suffix", EAGLE3: "eagle3", MOA: "moa", MEDUSA: "medusa"}.get(checkpoint_kind(name))


def available_drafters() -> list[str]:
    return ["none", "auto", *sorted(_REGISTRY), _lookahead().SPEC_USAGE.split(" ")[0], "NAME+NAME[+...]"]


def resolve_drafter(name: str | None, target) -> str | None:
    """'auto' -> the best training-free drafter for `target`: the suffix drafter when a corpus of
    the target's answers is shipped for it (drafters/, SmolLM2), else n-gram. Other names unchanged."""
    if name != "auto":
        return name
    try:
        shipped_path(target, "suffix")
    except CheckpointError:
        return "ngram"
    return "suffix"


def make_drafter(name: str | None, target) -> Drafter | None:
    """A drafter for `target` by registry name or directory ('auto': see resolve_drafter);
    'none' (or None) means vanilla decoding."""
    name = resolve_drafter(name, target)
    if name in (None, "none", "vanilla"):
        return None
    members = merge_members(name)
    if members is not None:
        return _merged().MergedDrafter([make_drafter(m, target) for m in members], members)
    kind = drafter_kind(name)
    if kind is None:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    factory = _REGISTRY[kind].factory
    if kind == name:
        return factory(target)
    if kind == "lookahead":
        return factory(target, *_lookahead().parse_spec(name))
    return factory(target, name)


def default_tree(drafter: str | None) -> TreeShape:
    """The tree shape a drafter (registry name or directory) drafts with by default: its registry
    entry's; FALLBACK_TREE for names outside the registry and for 'none'. The edge client uses it too."""
    members = merge_members(drafter)
    if members is not None:  # (drafters/merged.py: merged_default_tree)
        return _merged().merged_default_tree([default_tree(m) for m in members])
    kind = drafter_kind(drafter)
    if kind == "lookahead" and drafter != "lookahead":
        return _lookahead().lookahead_tree(*_lookahead().parse_spec(drafter))
    return _REGISTRY[kind].default_tree if kind else FALLBACK_TREE


__all__ = [
    "DraftInput",
    "Drafter",
    "DrafterError",
    "DrafterSpec",
    "DraftModelDrafter",
    "FALLBACK_TREE",
    "NgramDrafter",
    "SHIPPED",
    "TargetCapture",
    "available_drafters",
    "default_tree",
    "drafter_kind",
    "is_suffix_corpus",
    "make_drafter",
    "merge_members",
    "register_drafter",
    "require_drafter",
    "resolve_drafter",
    "shipped_path",
]
