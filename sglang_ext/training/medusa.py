"""Medusa-1 training: the heads over the frozen target's last hidden states, one teacher-forced pass.

Indexing (row u of a sequence x_0..x_{L-1}; h_u the target's final-norm'd hidden at u, whose own
lm_head prediction is x_{u+1}):

    head k (0-based) on h_u  ->  x_{u+k+2}          (head 0: the token after the next one)
    counted where u+k+2 < length and x_{u+k+2} is an assistant token
    loss    sum_k decay**k * CE_k      (Medusa's lambda_k = 0.8**k), CE_k the mean over counted rows;
            a label outside the draft vocab adds nothing to CE_k (the heads cannot score it) but
            counts in its denominator, and as a miss in acc_k
    acc_k   top-1 accuracy of head k over its counted rows

Labels are the data's tokens (hard targets). On the target's own answers (`moa-serve distill`, the
shards-distill data) those are the target's greedy continuations, which is what verification accepts.

Dense over [B, T] with masks, no boolean gathers and no host reads: a step never waits on the host.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.llama import LlamaModel
from ..models.medusa import MedusaHeads
from .data import Batch
from .eagle3 import default_autocast, shift
from .target import TargetOutputs


def head_labels(batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head k's label at every row u: x_{u+k+2}, and whether it counts.

    returns labels [B, T] int64 (0 where out of range), counted [B, T] bool
    """
    t = batch.input_ids.shape[1]
    ahead = k + 2
    in_range = torch.arange(t, device=batch.lengths.device)[None, :] + ahead < batch.lengths[:, None]
    return shift(batch.input_ids, ahead), in_range & shift(batch.loss_mask, ahead)


class MedusaTask:
    """The Medusa heads as a task of the shared Trainer (see trainer.Task)."""

    name = "medusa"
    needs_kv = False
    capture_layers: tuple[int, ...] = ()  # reads TargetOutputs.hidden (after the final norm)

    def __init__(self, target: LlamaModel, heads: MedusaHeads, decay: float = 0.8, autocast: bool | None = None):
        self.target, self.heads, self.decay = target, heads, decay
        self.autocast = default_autocast(target.device) if autocast is None else autocast
        hot = heads.hot_ids.to(target.device)
        self.lm_rows = target.lm_head[hot].detach().float()  # [Vd, H] frozen, shared with the target
        self.to_draft = heads.target_to_draft().to(target.device)  # [V] draft index, -1 outside

    @property
    def module(self) -> torch.nn.Module:
        return self.heads

    def loss(self, batch: Batch, tout: TargetOutputs, progress: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast(self.target.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            z = self.heads.logits(tout.hidden.float(), self.lm_rows)  # [B, T, K, Vd]
        total, metrics = 0.0, {}
        labelled = [head_labels(batch, k) for k in range(self.heads.cfg.num_heads)]  # per head [B, T] each
        denoms = batch.total(torch.stack([c.sum() for _, c in labelled])).clamp(min=1)  # [K] over every rank
        for k, (labels, counts) in enumerate(labelled):
            idx = self.to_draft[labels]  # [B, T] draft index, -1 outside the draft vocab
            zk = z[:, :, k].float()
            ce = F.cross_entropy(zk.flatten(0, 1), idx.clamp(min=0).flatten(), reduction="none").view_as(idx)
            denom = denoms[k]
            head_loss = torch.where(counts & (idx >= 0), ce, 0.0).sum() / denom
            total = total + self.decay**k * head_loss
            with torch.no_grad():
                hit = (zk.argmax(-1) == idx) & counts & (idx >= 0)
                metrics[f"loss_{k}"], metrics[f"acc_{k}"] = head_loss.detach(), hit.sum() / denom
        metrics["loss"] = total.detach()
        return total, metrics

    def save(self, out_dir: str | Path, extra_config: dict | None = None) -> None:
        self.heads.save(out_dir, extra_config=extra_config)
