"""The target run online, without grad, over a padded batch: what every draft type trains from.

On the CPU the batch's sequences go through our LlamaModel forward unpadded (flat, one causal plan
per sequence, like a prefill, on the CPU kernels), then are scattered back to the padded [B, T]
layout. On an accelerator the padded batch runs as it is (`LlamaModel.forward_padded`: fused causal
attention, no KV pool, no plan), so nothing is built on the host per step:

    flat rows:  [a0 a1 a2 | b0 b1]          lengths = [3, 2]
    padded:     [[a0 a1 a2],
                 [b0 b1 --]]                 (pad rows are zeros on the CPU; unread garbage otherwise)

Either way K/V come out in pool layout: per layer [S, Hkv, D] rows, token (b, t) at slots[b, t].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import causal_mask, plan_attention
from ..models.llama import LlamaModel
from .data import Batch


@dataclass
class TargetOutputs:
    hidden: torch.Tensor  # [B, T, H] after the final norm (target dtype)
    captured: dict[int, torch.Tensor]  # layer -> [B, T, H] output of that layer
    k: list[torch.Tensor]  # per layer [S, Hkv, D]: the target's keys (after RoPE) of every token, e.g. for MoA
    v: list[torch.Tensor]  # per layer [S, Hkv, D]
    slots: torch.Tensor  # [B, T] row of each token in k / v

    def logits(self, lm_head: torch.Tensor) -> torch.Tensor:
        """[B, T, V] target logits (target dtype)."""
        return F.linear(self.hidden, lm_head)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, Hkv, D] keys and values of one layer."""
        return self.k[layer][self.slots], self.v[layer][self.slots]


class TargetRunner:
    def __init__(self, model: LlamaModel, max_tokens: int):
        self.model = model
        self.max_tokens = max_tokens
        self.pooled = model.device.type == "cpu"
        # slot 0 stays unused (padding reads it)
        self.kv = model.new_kv_pool(max_tokens + 1) if self.pooled else None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.no_grad()
    def run(self, batch: Batch, capture_layers: tuple[int, ...], keep_kv: bool = True) -> TargetOutputs:
        n = batch.num_tokens if self.pooled else batch.input_ids.numel()
        if n > self.max_tokens:
            raise ValueError(f"batch has {n} tokens; the target runner was sized for {self.max_tokens}")
        return (
            self._run_pooled(batch, capture_layers) if self.pooled else self._run_padded(batch, capture_layers, keep_kv)
        )

    def _run_padded(self, batch: Batch, capture_layers: tuple[int, ...], keep_kv: bool) -> TargetOutputs:
        b, t = batch.input_ids.shape
        out = self.model.forward_padded(batch.input_ids, capture_layers, keep_kv)
        slots = torch.arange(b * t, device=self.device).view(b, t)
        flat = [x.reshape(b * t, *x.shape[2:]) for x in out.k], [x.reshape(b * t, *x.shape[2:]) for x in out.v]
        return TargetOutputs(out.hidden, out.captured, *flat, slots)

    def _run_pooled(self, batch: Batch, capture_layers: tuple[int, ...]) -> TargetOutputs:
        n = batch.num_tokens
        b, t = batch.input_ids.shape
        valid = torch.arange(t)[None, :] < batch.lengths[:, None]  # [B, T]
        slots = torch.zeros(b, t, dtype=torch.long)
        slots[valid] = torch.arange(1, n + 1)
        flat_slots = slots[valid]
        kv_lists = [slots[i, : int(batch.lengths[i])] for i in range(b)]
        plan = plan_attention(kv_lists, [causal_mask(int(l), 0) for l in batch.lengths])
        positions = torch.arange(t).expand(b, t)[valid]
        out = self.model.forward(batch.input_ids[valid], positions, flat_slots, plan, self.kv, capture_layers)
        captured = {l: self._pad(h, valid) for l, h in out.captured.items()}
        return TargetOutputs(self._pad(out.hidden, valid), captured, self.kv.k, self.kv.v, slots)

    @staticmethod
    def _pad(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(*valid.shape, x.shape[-1])
        out[valid] = x
        return out
