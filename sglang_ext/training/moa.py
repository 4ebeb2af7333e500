"""MoA training: one teacher-forced pass with masks that simulate partially accepted drafts.

Verification points (per sequence): p_0 = 0, p_{k+1} = p_k + K with K ~ U[min_gap, max_gap]. For
a row i >= 1 let v(i) = the last point strictly before i: the target has verified tokens 0..v(i)
and rows v(i)+1..i play the root and the draft nodes of one draft-verify cycle
(row v+1 = root, row v+1+d = depth-d node on the ground-truth path). Hence, for query row i:

    CA   sees memory (LSA of target K/V) of rows j <= v(i)
    SA   causal (j <= i); "staircase" (applied to a sequence with probability ramping 0 -> 1 over
         the first half of training): j <= v(i) or j == i, as the drafter runs it at inference
    TLI  the target's last N layers see the target's real K/V for j <= v(i) and the draft's own
         K/V for v(i) < j <= i

    e.g. points {0, 4}:   i:   1 2 3 4 5 6
                          v:   0 0 0 0 4 4

Loss (HEBO): lambda_kl * KL(p_target || q_draft) over the draft vocab + lambda_feat * SmoothL1
between the CA output and the target's hidden state entering layer L-N (for TLI > 0 averaged with
SmoothL1 between the final draft hidden state and the target's last-layer output). Rows count
where the next token is an assistant token and the target's argmax is in the draft vocab; with
position_decay < 1 a row at draft depth d = i - v(i) - 1 weighs position_decay**d (EAGLE's decay over
draft steps), so the root and the first nodes, which every accepted token passes through, count most.
With sa_layers > 1 (an ablation) the SA layers run in turn under the same mask.
Row accuracy is reported per gap i - v(i) = 1.. (acc_0 = root rows, acc_1 = depth-1 rows, ...).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.llama import LlamaModel, apply_rope, rms_norm
from ..models.moa import MoADraft, stack_layer_kv
from .data import Batch
from .eagle3 import default_autocast
from .target import TargetOutputs


def last_points(b: int, t: int, min_gap: int, max_gap: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T] v(i): the last verification point strictly before row i (0 for i = 0), on the host
    (gen is a CPU generator; one draw per point, sequence by sequence)."""
    v = torch.zeros(b, t, dtype=torch.long)
    for s in range(b):
        nxt = 0
        while nxt < t - 1:  # rows point+1 .. nxt see `point` as their last verified token
            point = nxt
            nxt = point + int(torch.randint(min_gap, max_gap + 1, (1,), generator=gen))
            v[s, point + 1 : nxt + 1] = point
    return v


def ca_mask(v: torch.Tensor) -> torch.Tensor:
    """[B, T, T]: row i sees memory rows j <= v(i)."""
    t = v.shape[1]
    return torch.arange(t, device=v.device)[None, None, :] <= v[:, :, None]


def sa_mask(v: torch.Tensor, staircase: torch.Tensor) -> torch.Tensor:
    """[B, T, T]: causal, or (per sequence, staircase[b]) j <= v(i) or j == i."""
    t = v.shape[1]
    j = torch.arange(t, device=v.device)
    causal = j[None, :] <= j[:, None]
    stair = (j[None, None, :] <= v[:, :, None]) | torch.eye(t, dtype=torch.bool, device=v.device)[None]
    return torch.where(staircase[:, None, None], stair, causal[None])


def tli_masks(v: torch.Tensor) -> torch.Tensor:
    """[B, T, 2T]: [real K/V rows j <= v(i) | draft K/V rows v(i) < j <= i]."""
    t = v.shape[1]
    j = torch.arange(t, device=v.device)[None, None, :]
    real = j <= v[:, :, None]
    draft = (j > v[:, :, None]) & (j <= j.transpose(1, 2))
    return torch.cat([real, draft], dim=-1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, Hq, D]; k/v [B, S, Hkv, D]; mask [B, T, S] -> [B, T, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def tli_layer(
    model: LlamaModel,
    li: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    real_k: torch.Tensor,
    real_v: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Target layer li on draft hidden states x [B, T, H] (differentiable; target weights frozen),
    attending to [real K/V | x's own K/V] under mask [B, T, 2T]. Same math as LlamaModel.layer_forward."""
    c, lw = model.cfg, model.layers[li]
    dt = x.dtype
    h = rms_norm(x, lw.input_norm.to(dt), c.rms_norm_eps)
    qkv = F.linear(h, lw.qkv.to(dt), None if lw.qkv_bias is None else lw.qkv_bias.to(dt))
    nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q = qkv[..., :nq].unflatten(-1, (c.num_heads, c.head_dim))
    k = qkv[..., nq : nq + nk].unflatten(-1, (c.num_kv_heads, c.head_dim))
    v = qkv[..., nq + nk :].unflatten(-1, (c.num_kv_heads, c.head_dim))
    freqs = positions.float()[..., None] * model.inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys = torch.cat([real_k.to(k.dtype), k], dim=1)
    values = torch.cat([real_v.to(v.dtype), v], dim=1)
    a = _attend(q, keys, values, mask, model.scale)
    x = x + F.linear(a.flatten(-2), lw.o.to(dt))
    h = rms_norm(x, lw.post_norm.to(dt), c.rms_norm_eps)
    gu = F.linear(h, lw.gate_up.to(dt))
    inter = gu.shape[-1] // 2
    return x + F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], lw.down.to(dt))


class MoATask:
    """MoA for the shared Trainer. Like Eagle3Task, the loss is dense over [B, T] rows with masks
    (no boolean gathers), so a step on an accelerator never waits on the host."""

    needs_kv = True

    def __init__(
        self,
        target: LlamaModel,
        draft: MoADraft,
        lambda_kl: float = 0.1,
        lambda_feat: float = 1.0,
        min_gap: int = 6,
        max_gap: int = 14,
        staircase_ramp: float = 0.5,
        staircase_max: float = 1.0,
        seed: int = 0,
        autocast: bool | None = None,
        position_decay: float = 1.0,
    ):
        if not 1 <= min_gap <= max_gap:
            raise ValueError(f"need 1 <= min_gap <= max_gap, got {min_gap}, {max_gap}")
        if not 0.0 < position_decay <= 1.0:
            raise ValueError(f"need 0 < position_decay <= 1, got {position_decay}")
        self.position_decay = position_decay
        self.target, self.draft = target, draft
        self.name = f"moa-tli{draft.cfg.tli}"
        self.lambda_kl, self.lambda_feat = lambda_kl, lambda_feat
        self.min_gap, self.max_gap = min_gap, max_gap
        self.staircase_ramp, self.staircase_max = staircase_ramp, staircase_max
        self.autocast = default_autocast(target.device) if autocast is None else autocast
        self.gen = torch.Generator().manual_seed(seed)
        n, tli = len(target.layers), draft.cfg.tli
        self.feature_layer = n - 1 - tli  # its output enters layer L-N: what the CA output imitates
        self.capture_layers = tuple(sorted({self.feature_layer, n - 1}))  # n - 1 also feeds the no-LSA ablation
        self.tli_layers = list(range(n - tli, n))

    @property
    def module(self) -> torch.nn.Module:
        return self.draft

    def staircase_prob(self, progress: float) -> float:
        return (
            self.staircase_max * min(1.0, progress / self.staircase_ramp)
            if self.staircase_ramp > 0
            else self.staircase_max
        )

    def loss(self, batch: Batch, tout: TargetOutputs, progress: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t, rows = batch.input_ids.shape[1], batch.global_rows
        device = batch.input_ids.device
        # drawn for every row of the global batch, then this rank's rows kept: the same draws for any world size
        v = _to_device(batch.own(last_points(rows, t, self.min_gap, self.max_gap, self.gen)), device)
        stair = _to_device(batch.own(torch.rand(rows, generator=self.gen) < self.staircase_prob(progress)), device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
            hidden, feat = self.forward(batch, tout, v, stair)
            return self._loss(batch, tout, v, hidden, feat)

    def forward(self, batch: Batch, tout: TargetOutputs, v: torch.Tensor, stair: torch.Tensor):
        """-> final draft hidden [B, T, H] (before the target norm), CA output [B, T, H]."""
        d, ids = self.draft, batch.input_ids
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).expand(b, t)
        if d.cfg.memory_source == "last_hidden":
            memory = tout.captured[len(self.target.layers) - 1]
        else:
            # every row, padding included: a real row's CA only reads rows j <= v(i) < its length
            memory = d.lsa(stack_layer_kv(tout.k, tout.v, tout.slots.reshape(-1))).view(b, t, -1)
        embeds = self.target.embed[ids]
        q, k, vv = d.sa_qkv(embeds, pos)
        mask = sa_mask(v, stair)
        x = d.sa_finish(_attend(q, k, vv, mask, d.scale), embeds)
        rope = None  # cos/sin of the positions, made once for the extra SA layers
        for layer in getattr(d, "more_self_attention", ()):
            q, k, vv = layer.qkv(x)
            cos, sin = rope = rope or d.rope(pos, q.dtype)
            x = layer.finish(_attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), vv, mask, d.scale), x)
        ck, cv = d.ca_kv(memory, pos)
        feat = d.ca_finish(_attend(d.ca_q(x, pos), ck, cv, ca_mask(v), d.scale), x)
        x = feat
        if self.tli_layers:
            m = tli_masks(v)
            for li in self.tli_layers:
                x = tli_layer(self.target, li, x, pos, *tout.layer_kv(li), m)
        return x, feat

    def _loss(self, batch, tout, v, hidden, feat):
        d = self.draft
        counts = batch.counted()
        head = self.target.lm_head[d.hot_ids]
        with torch.no_grad():
            tl = tout.logits(self.target.lm_head)  # [B, T, V]
            top = tl.argmax(-1)
            inv = torch.full((d.cfg.vocab_size,), -1, dtype=torch.long, device=top.device)
            inv[d.hot_ids] = torch.arange(d.hot_ids.numel(), device=top.device)
            w = counts & (inv[top] >= 0)  # [B, T] rows that count
            p = torch.softmax(tl[..., d.hot_ids].float(), dim=-1)
            gap = torch.arange(v.shape[1], device=v.device)[None, :] - v
            sel = [(gap == g) & w for g in range(1, 8)]  # rows at draft depth g - 1
            n, *n_sel = batch.total(torch.stack([w.sum(), *(s.sum() for s in sel)])).clamp(min=1)
            rw = None  # uniform: each counted row weighs 1 / n
            if self.position_decay < 1.0:  # [B, T] row weights, summing to 1 over the global batch
                rw = torch.where(w, self.position_decay ** (gap - 1).clamp(min=0).float(), 0.0)
                rw = rw / batch.total(rw.sum()).clamp(min=1e-9)
        z = F.linear(
            rms_norm(hidden, self.target.norm.to(hidden.dtype), self.target.cfg.rms_norm_eps), head.to(hidden.dtype)
        ).float()
        logq = torch.log_softmax(z, dim=-1)
        kl = _row_mean((p * (torch.log(p.clamp_min(1e-20)) - logq)).sum(-1), w, n, rw)
        feat_loss = _row_smooth_l1(feat, tout.captured[self.feature_layer], w, n, rw)
        if self.tli_layers:
            last = tout.captured[len(self.target.layers) - 1]
            feat_loss = 0.5 * (feat_loss + _row_smooth_l1(hidden, last, w, n, rw))
        loss = self.lambda_kl * kl + self.lambda_feat * feat_loss
        metrics = {"loss": loss.detach(), "kl": kl.detach(), "feat": feat_loss.detach()}
        with torch.no_grad():
            hit = (d.hot_ids[z.argmax(-1)] == top) & w
            metrics["acc"] = hit.sum() / n
            for g, (s, n_s) in enumerate(zip(sel, n_sel)):
                metrics[f"acc_{g}"] = (hit & s).sum() / n_s
        return loss, metrics

    def save(self, out_dir: str | Path, extra_config: dict | None = None) -> None:
        self.draft.save(out_dir, extra_config=extra_config)


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for it: a copy from pageable memory would first
    wait for every queued kernel, so it goes through pinned memory."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _row_mean(per_row: torch.Tensor, w: torch.Tensor, n: torch.Tensor, rw: torch.Tensor | None) -> torch.Tensor:
    """per_row [B, T] averaged over the rows where w [B, T] holds: n of them in the global batch, or with
    the row weights rw [B, T] (summing to 1 over the global batch)."""
    if rw is None:
        return torch.where(w, per_row, 0.0).sum() / n
    return torch.where(w, rw * per_row, 0.0).sum()


def _row_smooth_l1(x, target, w, n, rw) -> torch.Tensor:
    """SmoothL1 over each row's elements, then _row_mean."""
    return _row_mean(F.smooth_l1_loss(x.float(), target.float(), reduction="none").mean(-1), w, n, rw)
