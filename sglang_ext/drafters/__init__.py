"""Drafters behind one interface (base.Drafter), built by name from one registry."""

from __future__ import annotations

from typing import Callable

from ..models.checkpoint import EAGLE3, MOA, SUFFIX_CORPUS, checkpoint_kind
from .base import Drafter, DrafterError, DraftInput, TargetCapture
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

# name -> factory(target_model) ; EAGLE-3 and MoA register here too
_REGISTRY: dict[str, Callable[..., Drafter]] = {
    "ngram": lambda target: NgramDrafter(),
    "lookahead": lambda target, *window_ngram: _lookahead().LookaheadDrafter(*window_ngram),
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


def _lookahead():
    from . import lookahead

    return lookahead


def _moa():
    from . import moa

    return moa


def register_drafter(name: str, factory: Callable[..., Drafter]) -> None:
    _REGISTRY[name] = factory


def is_suffix_corpus(path: str) -> bool:
    """A directory written by `moa-serve build-corpus`."""
    return checkpoint_kind(path) == SUFFIX_CORPUS


def available_drafters() -> list[str]:
    return ["none", "auto", *sorted(_REGISTRY), _lookahead().SPEC_USAGE.split(" ")[0]]


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
    if name not in _REGISTRY and (spec := _lookahead().parse_spec(name)) is not None:
        return _REGISTRY["lookahead"](target, *spec)  # lookahead-wW-nN
    if name not in _REGISTRY:
        # --drafter PATH: a corpus from `moa-serve build-corpus`, an EAGLE-3 or a MoA checkpoint directory
        kind = checkpoint_kind(name)
        if kind is not None:
            return _REGISTRY[{SUFFIX_CORPUS: "suffix", EAGLE3: "eagle3", MOA: "moa"}[kind]](target, name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return _REGISTRY[name](target)


def default_tree(drafter: str | None):
    """Tree shape tuned per drafter (see docs/BENCHMARKS.md for the sweeps); the edge client uses it too."""
    from ..tree import TreeShape

    # EAGLE-3 and MoA share one tree budget, so their numbers compare. On this CPU each verify row
    # costs ~1/8 of a decode and each draft step a head forward, so one draft step with two candidates
    # is fastest even with the GPU-trained heads (tau 2.1 at 6,4,24): EAGLE-3 1.02x vanilla at 1,2,3,0.1
    # against 0.98x at 2,2,4,0.1 and 0.34x at 6,4,24 (2-core Xeon, six eval sets, docs/BENCHMARKS.md).
    # min_prob 0.1: nodes of draft probability < 0.1 were accepted ~6 % of the time, not worth a
    # verify row here (docs/BENCHMARKS.md, "Tree shapes"). On a GPU a tree verify costs about a decode.
    eagle_like = TreeShape(1, 2, 3, min_prob=0.1)
    if drafter and is_suffix_corpus(drafter):
        drafter = "suffix"  # --drafter PATH to a corpus
    if drafter != "lookahead" and (spec := _lookahead().parse_spec(drafter)) is not None:
        return _lookahead().lookahead_tree(*spec)  # lookahead-wW-nN: a chain of its window
    # suffix: a 3-token chain. A chain beat 8,3,24; with the matmuls on the GGUF blocks a decode no
    # longer waits on memory, each verify row costs ~1/4 of a decode, and the 3-chain won over six
    # sets on a 2-core AMD EPYC: 1.37x vs 1.30x for the 5-chain in one run, 1.40x vs 1.37x / 1.27x
    # for the 2- / 4-chains in another; again on a 2-core Xeon once 5-8 row verifies got cheaper:
    # 1.21x vs 1.18x / 1.15x / 1.05x for the 4- / 5- / 7-chains
    return {
        "ngram": TreeShape(6, 2, 12),
        "suffix": TreeShape(3, 1, 4),
        "lookahead": _lookahead().lookahead_tree(),  # lookahead-wW-nN: see above
        "draft-model": TreeShape(3, 1, 4),
        "eagle3": eagle_like,
        "moa": eagle_like,
        "moa-tli0": eagle_like,
        "moa-tli1": eagle_like,
    }.get(drafter or "none", TreeShape(6, 4, 24))


__all__ = [
    "DraftInput",
    "Drafter",
    "DrafterError",
    "DraftModelDrafter",
    "NgramDrafter",
    "TargetCapture",
    "available_drafters",
    "default_tree",
    "is_suffix_corpus",
    "make_drafter",
    "register_drafter",
    "resolve_drafter",
]
