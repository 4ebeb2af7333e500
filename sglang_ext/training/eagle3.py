"""EAGLE-3 training-time test (TTT): the draft is unrolled for `ttt_length` steps, feeding its
own output features back, exactly as it is used at inference.

Indexing (row t of a sequence x_0..x_{L-1}, step j = draft depth):

    input   embed(x_{t+1+j}) and feature  f_t (j = 0, fused target layers) | out_{j-1, t} (j > 0)
    RoPE    position t + j
    attends step-0 keys of rows s <= t (the verified prefix + the chain's root) and its own
            chain's keys of steps 1..j at row t (diagonal), as tree drafting does at inference
    target  softmax over the draft vocab of the target's logits at position t+1+j (which predict
            x_{t+2+j}); counted where x_{t+2+j} is an assistant token and masked where the
            target's argmax is outside the draft vocab
    weight  decay**j (0.8)

    step 0 keys:  k0[0] k0[1] ... k0[t]            (causal)
    step j keys:                      k1[t] ... kj[t]  (diagonal)
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import cpu_has_fast_bf16
from ..models.eagle3 import Eagle3Draft
from ..models.llama import LlamaModel
from .data import Batch
from .target import TargetOutputs


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, k:] right-padded with zeros (False) back to length T."""
    if k == 0:
        return x
    pad = x.new_zeros(x.shape[0], k, *x.shape[2:])
    return torch.cat([x[:, k:], pad], dim=1)


def unshift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, :-k] left-padded with zeros back to length T: row t moves to row t + k (shift's inverse)."""
    if k == 0:
        return x
    pad = x.new_zeros(x.shape[0], k, *x.shape[2:])
    return torch.cat([pad, x[:, :-k]], dim=1)


def _heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, Hq, T, D] (GQA heads repeated)."""
    return x.repeat_interleave(rep, dim=2).transpose(1, 2)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """q [B, T, Hq, D]; keys/values: step 0 as [B, Hq, T, D] (causal), later steps [B, T, Hkv, D]
    (diagonal) -> [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    rep = hq // keys[-1].shape[2] if len(keys) > 1 else 1
    q = q * scale
    qh = q.transpose(1, 2)
    s0 = (qh @ keys[0].transpose(-1, -2)).float() + _causal_bias(t, q.device)
    diag = [(q * k.repeat_interleave(rep, dim=2)).sum(-1).transpose(1, 2).float()[..., None] for k in keys[1:]]
    p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
    p0, pd = p.split(
        [t, len(diag)], dim=-1
    )  # NOTE: one split, not per-column slices (whose backward fills full-size zeros)
    out = p0.to(q.dtype) @ values[0]  # [B, Hq, T, D]
    for i, v in enumerate(values[1:]):
        out = out + pd[..., i, None].to(v.dtype) * _heads(v, rep)
    return out.transpose(1, 2)


_BIAS: dict[tuple[int, str], torch.Tensor] = {}


def _causal_bias(t: int, device: torch.device) -> torch.Tensor:
    key = (t, str(device))
    if key not in _BIAS:
        _BIAS[key] = torch.full((t, t), float("-inf"), device=device).triu(1)
    return _BIAS[key]


class Eagle3Task:
    """One model type for the shared Trainer: holds the draft, computes the TTT loss, saves.

    The loss is computed densely over every [B, T] row with masks (no boolean gathers), so a step
    on an accelerator never waits on the host; metrics stay tensors until the trainer logs them."""

    name = "eagle3"
    needs_kv = False

    def __init__(
        self,
        target: LlamaModel,
        draft: Eagle3Draft,
        ttt_length: int = 7,
        decay: float = 0.8,
        autocast: bool | None = None,
    ):
        self.target, self.draft = target, draft
        self.ttt_length, self.decay = ttt_length, decay
        self.autocast = default_autocast(target.device) if autocast is None else autocast
        self.capture_layers = tuple(draft.cfg.aux_layers)
        self.scale = draft.cfg.head_dim**-0.5

    @property
    def module(self) -> torch.nn.Module:
        return self.draft

    def loss(self, batch: Batch, tout: TargetOutputs, progress: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast(self.target.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self._loss(batch, tout)

    def _targets(self, batch: Batch, tout: TargetOutputs):
        """For each position u: whether its prediction counts, whether it also has the target's argmax
        inside the draft vocab (`weight`), the target's argmax and its probabilities over the draft vocab.

        returns counts [B, T] bool, weight [B, T] bool, top [B, T] int64, probs [B, T, Vd] fp32
        """
        counts = batch.counted()
        with torch.no_grad():
            logits = tout.logits(self.target.lm_head)  # [B, T, V]
            top = logits.argmax(-1)
            weight = counts & self.draft.t2d[top]
            probs = torch.softmax(logits[..., self.draft.hot_ids].float(), dim=-1)
        return counts, weight, top, probs

    def _loss(self, batch: Batch, tout: TargetOutputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d, ids = self.draft, batch.input_ids
        counts, weight, top, probs = self._targets(batch, tout)
        aux = torch.cat([tout.captured[l] for l in self.capture_layers], dim=-1)
        feat = d.fuse(aux)
        embed = self.target.embed
        b, t = ids.shape
        c = d.cfg
        rep = c.num_heads // c.num_kv_heads
        rows = torch.arange(t, device=ids.device)
        keys, values, total, metrics = [], [], 0.0, {}
        # row t counts at step j where its target u = t + 1 + j has a row (u >= 1 + j): one count per step
        reach = rows[None, :] >= 1 + torch.arange(self.ttt_length, device=ids.device)[:, None]  # [J, T]
        denoms = batch.total((counts[None] & reach[:, None]).sum((1, 2))).clamp(min=1)  # [J] over every rank
        for j in range(self.ttt_length):
            q, k, v = d.qkv(embed[shift(ids, 1 + j)], feat, (rows + j).expand(b, t))
            keys.append(_heads(k, rep) if j == 0 else k)
            values.append(_heads(v, rep) if j == 0 else v)
            feat = d.finish(ttt_attention(q, keys, values, self.scale), feat)
            # row t at step j is scored against the target at u = t + 1 + j: feat moved to row u
            z = d.logits(unshift(feat, 1 + j)).float()  # [B, T, Vd] at u
            ce = -(probs * torch.log_softmax(z, dim=-1)).sum(-1)  # [B, T]
            step_loss = torch.where(weight & reach[j], ce, 0.0).sum() / denoms[j]
            total = total + self.decay**j * step_loss
            with torch.no_grad():
                hit = (d.hot_ids[z.argmax(-1)] == top) & weight & reach[j]
                metrics[f"loss_{j}"], metrics[f"acc_{j}"] = step_loss.detach(), hit.sum() / denoms[j]
        metrics["loss"] = total.detach()
        return total, metrics

    def save(self, out_dir: str | Path, extra_config: dict | None = None) -> None:
        self.draft.save(out_dir, extra_config=extra_config)


def default_autocast(device: torch.device) -> bool:
    """bf16 autocast on accelerators; on the CPU only where bf16 beats fp32 (AMX: see cpu_has_fast_bf16)."""
    return device.type != "cpu" or cpu_has_fast_bf16()
