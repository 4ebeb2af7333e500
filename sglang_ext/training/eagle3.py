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
import torch.nn.functional as F

from ..models.eagle3 import Eagle3Draft
from ..models import cpu_has_fast_bf16
from ..models.llama import LlamaModel
from .data import Batch
from .target import TargetOutputs


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, k:] right-padded with zeros (False) back to length T."""
    if k == 0:
        return x
    pad = x.new_zeros(x.shape[0], k, *x.shape[2:])
    return torch.cat([x[:, k:], pad], dim=1)


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
    p0, pd = p.split([t, len(diag)], dim=-1)  # NOTE: one split, not per-column slices (whose backward fills full-size zeros)
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
    """One model type for the shared Trainer: holds the draft, computes the TTT loss, saves."""

    name = "eagle3"

    def __init__(self, target: LlamaModel, draft: Eagle3Draft, ttt_length: int = 7, decay: float = 0.8, autocast: bool | None = None):
        self.target, self.draft = target, draft
        self.ttt_length, self.decay = ttt_length, decay
        # bf16 autocast only where bf16 beats fp32 on this CPU (AMX: see cpu_has_fast_bf16)
        self.autocast = cpu_has_fast_bf16() if autocast is None else autocast
        self.capture_layers = tuple(draft.cfg.aux_layers)
        self.scale = draft.cfg.head_dim**-0.5

    @property
    def module(self) -> torch.nn.Module:
        return self.draft

    def loss(self, batch: Batch, tout: TargetOutputs, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return self._loss(batch, tout)

    def _targets(self, batch: Batch, tout: TargetOutputs):
        """Positions u whose prediction counts (the token after u is an assistant token), and for those
        inside the draft vocab the target's probabilities over it.

        returns counts [B, T] bool, (b, u) indices of in-vocab counted positions, probs [N, Vd], top [B, T]
        """
        b, t = batch.input_ids.shape
        in_range = torch.arange(t)[None, :] + 1 < batch.lengths[:, None]
        counts = in_range & shift(batch.loss_mask, 1)
        with torch.no_grad():
            logits = tout.hidden[counts] @ self.target.lm_head.T  # [Nc, V]
            top = torch.zeros(b, t, dtype=torch.long)
            top[counts] = logits.argmax(-1)
            ok = self.draft.t2d[top[counts]]
            probs = torch.softmax(logits[ok][:, self.draft.hot_ids].float(), dim=-1)
        bi, ui = counts.nonzero(as_tuple=True)
        return counts, (bi[ok], ui[ok]), probs, top

    def _loss(self, batch: Batch, tout: TargetOutputs) -> tuple[torch.Tensor, dict[str, float]]:
        d, ids = self.draft, batch.input_ids
        counts, (bi, ui), probs, top = self._targets(batch, tout)
        aux = torch.cat([tout.captured[l] for l in self.capture_layers], dim=-1)
        feat = d.fuse(aux)
        embed = self.target.embed
        b, t = ids.shape
        c = d.cfg
        rep = c.num_heads // c.num_kv_heads
        keys, values, total, metrics = [], [], 0.0, {}
        for j in range(self.ttt_length):
            q, k, v = d.qkv(embed[shift(ids, 1 + j)], feat, (torch.arange(t) + j).expand(b, t))
            keys.append(_heads(k, rep) if j == 0 else k)
            values.append(_heads(v, rep) if j == 0 else v)
            feat = d.finish(ttt_attention(q, keys, values, self.scale), feat)
            # row t at step j is scored against the target at u = t + 1 + j
            # NOTE: rows are gathered at clamped indices and weighted, so `probs` is never re-gathered
            sel = ui >= 1 + j
            z = d.logits(feat[bi, (ui - 1 - j).clamp(min=0)]).float()  # [N, Vd]
            denom = counts[:, 1 + j :].sum().clamp(min=1)
            step_loss = (F.cross_entropy(z, probs, reduction="none") * sel).sum() / denom
            total = total + self.decay**j * step_loss
            with torch.no_grad():
                acc = ((d.hot_ids[z.argmax(-1)] == top[bi, ui]) & sel).sum() / denom
            metrics[f"loss_{j}"], metrics[f"acc_{j}"] = step_loss.item(), acc.item()
        metrics["loss"] = float(total.detach())
        return total, metrics

    def save(self, out_dir: str | Path, extra_config: dict | None = None) -> None:
        self.draft.save(out_dir, extra_config=extra_config)
