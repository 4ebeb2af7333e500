"""The drafters shipped in the repo's drafters/ folder (in a wheel: sglang_ext/drafters/packaged/), per target:
one table and one lookup for every drafter family (the registry, EAGLE-3, MoA, Medusa and the suffix drafter all
resolve through it).

    shipped_path(target, "moa")   -> drafters/smollm2-moa-tli1   ('moa' is the better shipped TLI)
    shipped_path(target, "eagle3", env=settings().eagle3)        ($MOA_SERVE_EAGLE3 first, when set)
"""

from __future__ import annotations

import re
from pathlib import Path

from ..models.checkpoint import CheckpointError, has_config

# the shipped drafters (model cards inside): an installed wheel carries them in this package (setup.py puts
# the repo's drafters/ there); a source tree or an editable install reads the repo's drafters/
PACKAGED_DIR = Path(__file__).resolve().parent / "packaged"
SHIPPED_DIR = PACKAGED_DIR if PACKAGED_DIR.is_dir() else Path(__file__).resolve().parents[2] / "drafters"

# target (its model directory's name) -> drafter name -> folder under drafters/
SHIPPED: dict[str, dict[str, str]] = {
    "SmolLM2-135M-Instruct": {
        "eagle3": "smollm2-eagle3",
        "moa-tli0": "smollm2-moa-tli0",
        "moa-tli1": "smollm2-moa-tli1",
        "medusa": "smollm2-medusa",
        "suffix": "smollm2-suffix",
    }
}
# a family's name -> the shipped variant it stands for (measured: docs/BENCHMARKS.md, trained drafters)
BEST: dict[str, dict[str, str]] = {"SmolLM2-135M-Instruct": {"moa": "moa-tli1"}}
# how to make one for another target
MAKE = {
    "eagle3": "train one (moa-serve train eagle3)",
    "moa": "train one (moa-serve train moa)",
    "medusa": "train them (moa-serve train medusa)",
    "suffix": "build one (moa-serve build-corpus)",
}


# a GGUF converted once (`--target-gguf`) lives in a directory named after the file: SmolLM2-135M-Instruct.Q4_1
_GGUF_SUFFIX = re.compile(r"\.(Q\d\w*|IQ\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def target_name(path) -> str:
    """The name the tables know a target by: its directory's name, without a GGUF quantization suffix."""
    return _GGUF_SUFFIX.sub("", Path(path).name) if path is not None else ""


def shipped_path(target, name: str, env: Path | None = None, error: type[Exception] = CheckpointError) -> Path:
    """The folder of drafter `name` shipped for `target` (`env`, an override from the environment, when
    set); `error` (a CheckpointError) naming what to do when none is shipped."""
    if env is not None:
        return env
    tname = target_name(target.path)
    real = BEST.get(tname, {}).get(name, name)
    sub = SHIPPED.get(tname, {}).get(real)
    path = SHIPPED_DIR / sub if sub else None
    if path is None or not has_config(path):
        make = MAKE.get(name.split("-")[0], "train one")
        raise error(f"no shipped {name!r} drafter for target {target.path}; {make} and pass its path: --drafter DIR")
    return path
