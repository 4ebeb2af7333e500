"""The plugin's options from the environment, below the modules that use them (algorithm, worker,
tree_attention), so registration and the worker import one way.

    MOA_SGLANG_TLI               the TLI the worker runs (default: the checkpoint's)
    MOA_SGLANG_DRAFT_ATTENTION   the draft passes' attention backend: one of settings.DRAFT_ATTENTION
"""

from __future__ import annotations

import logging

from ..models.moa import MoAConfig
from ..settings import DRAFT_ATTENTION, SettingsError, settings

logger = logging.getLogger(__name__)

TLI_ENV = "MOA_SGLANG_TLI"
DRAFT_ATTENTION_ENV = "MOA_SGLANG_DRAFT_ATTENTION"
BACKENDS = tuple(b for b in DRAFT_ATTENTION if b != "auto")  # what `auto` resolves to, per device


class MoAServerArgsError(ValueError):
    """A server-args combination (or plugin option) the MoA algorithm cannot run."""


def tli_override(cfg: MoAConfig) -> int:
    """The TLI the worker runs: $MOA_SGLANG_TLI when set (checked), else the checkpoint's."""
    try:
        tli = settings().sglang_tli
    except SettingsError as e:
        raise MoAServerArgsError(str(e)) from e
    if tli is None:
        return cfg.tli
    if not 0 <= tli <= cfg.num_target_layers:
        raise MoAServerArgsError(
            f"{TLI_ENV}={tli} outside [0, {cfg.num_target_layers}] (the target has {cfg.num_target_layers} layers)"
        )
    if tli != cfg.tli:
        logger.warning(
            "MoA: running TLI=%d although the checkpoint was trained with tli=%d (%s)", tli, cfg.tli, TLI_ENV
        )
    return tli


def draft_attention() -> str:
    """$MOA_SGLANG_DRAFT_ATTENTION, checked against the one list of values (settings.DRAFT_ATTENTION)."""
    try:
        return settings().draft_attention
    except SettingsError as e:
        raise MoAServerArgsError(str(e)) from e
