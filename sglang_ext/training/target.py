"""The target run online, without grad, over a padded batch: what every draft type trains from.

The batch's sequences go through our LlamaModel forward unpadded (flat, one causal plan per
sequence, like a prefill), then are scattered back to the padded [B, T] layout:

    flat rows:  [a0 a1 a2 | b0 b1]          lengths = [3, 2]
    padded:     [[a0 a1 a2],
                 [b0 b1 --]]                 (pad rows are zeros)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import causal_mask, plan_attention
from ..models.kv_pool import KVPool
from ..models.llama import LlamaModel
from .data import Batch


@dataclass
class TargetOutputs:
    hidden: torch.Tensor  # [B, T, H] after the final norm (target dtype)
    captured: dict[int, torch.Tensor]  # layer -> [B, T, H] output of that layer
    kv: KVPool  # the target's K/V of every token (for drafters that read the target cache, e.g. MoA)
    slots: torch.Tensor  # [B, T] slot of each token in kv (0 on padding)

    def logits(self, lm_head: torch.Tensor) -> torch.Tensor:
        """[B, T, V] target logits (target dtype)."""
        return F.linear(self.hidden, lm_head)


class TargetRunner:
    def __init__(self, model: LlamaModel, max_tokens: int):
        self.model = model
        self.kv = model.new_kv_pool(max_tokens + 1)  # slot 0 stays unused (padding reads it)
        self.max_tokens = max_tokens

    @torch.no_grad()
    def run(self, batch: Batch, capture_layers: tuple[int, ...]) -> TargetOutputs:
        n = batch.num_tokens
        if n > self.max_tokens:
            raise ValueError(f"batch has {n} tokens; the target runner was sized for {self.max_tokens}")
        b, t = batch.input_ids.shape
        valid = torch.arange(t)[None, :] < batch.lengths[:, None]  # [B, T]
        slots = torch.zeros(b, t, dtype=torch.long)
        slots[valid] = torch.arange(1, n + 1)
        flat_slots = slots[valid]
        kv_lists = [slots[i, : int(batch.lengths[i])] for i in range(b)]
        plan = plan_attention(kv_lists, [causal_mask(int(l), 0) for l in batch.lengths])
        positions = torch.arange(t).expand(b, t)[valid]
        out = self.model.forward(batch.input_ids[valid], positions, flat_slots, plan, self.kv, capture_layers)
        return TargetOutputs(self._pad(out.hidden, valid), {l: self._pad(h, valid) for l, h in out.captured.items()}, self.kv, slots)

    @staticmethod
    def _pad(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(*valid.shape, x.shape[-1])
        out[valid] = x
        return out
