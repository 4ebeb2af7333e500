"""Medusa heads (Medusa-1, Cai et al., 2024) and their checkpoint format.

K heads read the target's last hidden state h_u (after the final norm: what the target's lm_head
reads at position u, whose own prediction is token u+1). Head k (0-based) predicts token u+k+2:

    head k:  r_k = h + SiLU(W_k h + b_k)        (one residual block; `num_layers` of them in a row)
             logits_k = lm_rows @ r_k            lm_rows = the target's lm_head rows of the draft vocab

At inference u is the last verified token and the root (token u+1) is what the target verifies
next, so head 0 drafts depth 1 of the tree (the token after the root), head k depth k+1.

Shared, frozen lm_head: the paper gives each head its own copy of the lm_head, initialised from the
target's. For SmolLM2 a copy is 49152 x 576 = 28 M parameters per head (113 M for four, close to
the whole target), which a 2-core CPU cannot train in the time we have; the residual block alone
(576^2 + 576 = 332 K per head) is Medusa's own initialisation path, and with W_k = b_k = 0 head k
starts as exactly the target's next-token prediction. The heads score only the draft vocab (the
most frequent tokens of the target's answers, as EAGLE-3 and MoA do): four full-vocab heads cost
~0.8 of a target decode per draft step on the CPU, four 8192-row heads ~1/8.

Checkpoint: `config.json` (architectures ["MedusaHeads"], medusa_num_heads, medusa_num_layers,
hidden_size, vocab_size, draft_vocab_size) + safetensors with `medusa_head.{k}.{j}.linear.{weight,bias}`
(the reference implementation's names for the residual blocks) and `hot_ids` [Vd] (sorted target
ids of the draft vocab). A checkpoint with per-head lm_heads (`medusa_head.{k}.{K}.weight`) is
refused by name (unexpected weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import (
    CONFIG,
    MEDUSA,
    MEDUSA_ARCH,
    CheckpointError,
    check_fits,
    config_kind,
    load_state,
    read_config,
    read_weights,
    save_weights,
)
from .loader import LlamaConfig

DEFAULT_NUM_HEADS = 4
DEFAULT_DRAFT_VOCAB = 8192


@dataclass(frozen=True)
class MedusaConfig:
    kind: ClassVar[str] = MEDUSA
    hidden_size: int
    vocab_size: int  # target vocab
    draft_vocab_size: int  # rows of the target's lm_head the heads score (== vocab_size: all)
    num_heads: int = DEFAULT_NUM_HEADS
    num_layers: int = 1  # residual blocks per head
    extra: dict = field(default_factory=dict, compare=False)  # unknown config.json keys, kept on save

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1:
            raise CheckpointError(
                f"Medusa needs >= 1 head and >= 1 layer per head, got {self.num_heads} heads, {self.num_layers} layers"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise CheckpointError(f"draft_vocab_size {self.draft_vocab_size} outside [1, vocab_size {self.vocab_size}]")

    @classmethod
    def for_target(
        cls, target: LlamaConfig, num_heads: int = DEFAULT_NUM_HEADS, draft_vocab_size: int = DEFAULT_DRAFT_VOCAB
    ) -> "MedusaConfig":
        """draft_vocab_size 0 means the whole vocab."""
        vd = min(draft_vocab_size, target.vocab_size) if draft_vocab_size else target.vocab_size
        return cls(target.hidden_size, target.vocab_size, vd, num_heads)

    def to_hf(self) -> dict:
        return dict(self.extra) | {
            "architectures": [MEDUSA_ARCH],
            "model_type": "medusa",
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "shared_lm_head": True,
        }

    @classmethod
    def from_hf(cls, cfg: dict) -> "MedusaConfig":
        if config_kind(cfg) != MEDUSA:
            raise CheckpointError(f"not a Medusa checkpoint: architectures={cfg.get('architectures')}")
        if cfg.get("shared_lm_head", True) is not True:
            raise CheckpointError("only Medusa heads sharing the target's lm_head are supported (shared_lm_head true)")
        try:
            hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
            return cls(
                hidden_size=hidden,
                vocab_size=vocab,
                draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
                num_heads=int(cfg.get("medusa_num_heads", DEFAULT_NUM_HEADS)),
                num_layers=int(cfg.get("medusa_num_layers", 1)),
                extra={k: v for k, v in cfg.items() if k == "training"},
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"bad Medusa config: {type(e).__name__} {e}") from e


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero at init (the block starts as the identity)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The K heads' residual blocks and the draft vocab; the lm_head rows are passed in (the target's)."""

    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)]) for _ in range(cfg.num_heads)
        )
        self.register_buffer("hot_ids", torch.arange(cfg.draft_vocab_size, dtype=torch.long))

    def set_vocab(self, hot_ids: torch.Tensor) -> None:
        """hot_ids [Vd]: target ids of the draft vocab (stored sorted, distinct)."""
        hot = hot_ids.to(torch.long).sort().values
        if hot.numel() != self.cfg.draft_vocab_size or bool((hot[1:] == hot[:-1]).any()):
            raise ValueError(f"expected {self.cfg.draft_vocab_size} distinct draft ids, got {hot.numel()}")
        if hot.numel() and not 0 <= int(hot[0]) <= int(hot[-1]) < self.cfg.vocab_size:
            raise ValueError(f"draft ids outside the target vocab [0, {self.cfg.vocab_size})")
        self.hot_ids.copy_(hot)

    def target_to_draft(self) -> torch.Tensor:
        """[V] draft index of each target id, -1 outside the draft vocab."""
        out = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.hot_ids.device)
        out[self.hot_ids] = torch.arange(self.hot_ids.numel(), device=self.hot_ids.device)
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] (the target's final-norm'd hidden) -> [.., K, H], head k's input to the lm_head."""
        return torch.stack([head(hidden) for head in self.medusa_head], dim=-2)

    def logits(self, hidden: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """hidden [.., H], lm_rows [Vd, H] (the target's lm_head at hot_ids) -> [.., K, Vd]."""
        out = self(hidden)
        return F.linear(out, lm_rows.to(out.dtype))

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        cfg = self.cfg.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")} | (extra_config or {})
        save_weights(state, out)
        (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def load_medusa(
    ckpt_dir: str | Path, target_cfg: LlamaConfig | None = None, dtype: torch.dtype = torch.float32
) -> MedusaHeads:
    """Read a Medusa checkpoint (ours); check it against the target if given."""
    ckpt = Path(ckpt_dir).expanduser()
    cfg = MedusaConfig.from_hf(read_config(ckpt))
    if target_cfg is not None:
        check_fits(cfg, target_cfg)
    model = MedusaHeads(cfg)
    state = read_weights(ckpt)
    if "hot_ids" in state:
        state["hot_ids"] = state["hot_ids"].long()
    load_state(model, state, ckpt)
    hot = model.hot_ids
    if hot.numel() and (bool((hot[1:] <= hot[:-1]).any()) or int(hot[0]) < 0 or int(hot[-1]) >= cfg.vocab_size):
        raise CheckpointError(f"{ckpt}: hot_ids must be sorted, distinct target ids in [0, {cfg.vocab_size})")
    return model.to(dtype)


__all__ = ["MedusaConfig", "MedusaHeads", "ResBlock", "load_medusa"]
