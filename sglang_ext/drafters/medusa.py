"""Medusa-1 drafter: K heads over the target's last hidden state, one tree per step from their top-k.

State. A request keeps one vector: the target's final-norm'd hidden state at its last verified token
u (the output of the last layer, captured, through the target's final norm). The root (token u+1,
the bonus or the prompt's next token) is what the target verifies next; head k predicts token
u+k+2, i.e. tree depth k+1 (models/medusa.py). Heads never see the tree's tokens, so one forward of
K small heads per request drafts the whole tree.

Tree. Head d's top-k (d = 0..depth-1) are the candidates at depth d+1 under every node of depth d;
a node's score is the product of its path's head probabilities. The tree is the num_draft_tokens-1
best nodes by score (a child never outscores its parent, so they are closed under parents: what a
best-first walk from the root takes), chosen on the device from all candidates scored at once
(head_trees; nothing read back), within TreeShape's depth (at most K),
topk (children per node) and min_prob (no node of lower score). This is our dynamic search with
Medusa's independence assumption; the paper's fixed sparse tree is the same rule applied offline to
accuracies measured on a calibration set, while the per-step search adapts to how confident the
heads are for this request (a confident step gets a deep chain, an unsure one a wide first level).

Proposals are deterministic (top-k), so trees carry no draft_probs: the verifier treats them as point
masses, which keeps speculative sampling lossless.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..device import to_device
from ..models.checkpoint import check_fits
from ..models.llama import LlamaModel, rms_norm
from ..models.medusa import MedusaHeads, load_medusa
from ..tree import TokenTree, TreeShape, trees_from_candidates
from .base import Drafter, DrafterError, DraftInput, TargetCapture
from .search import Finite
from .shipped import shipped_path


def default_checkpoint(target) -> Path:
    """The Medusa heads shipped in drafters/ for this target."""
    return shipped_path(target, "medusa")


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, target: LlamaModel, heads: MedusaHeads):
        check_fits(heads.cfg, target.cfg)
        self.target = target
        self.heads = heads.to(target.device, torch.float32).eval()
        self.last_layer = target.cfg.num_layers - 1
        self.capture_layers = (self.last_layer,)  # its output, through the target's final norm = h_u
        self.reads_prefix_hidden = False  # the last token's row only: never a prefix-cached one (drafters/base.py)
        self.hot_ids = self.heads.hot_ids
        self.lm_rows = target.lm_head[self.hot_ids.to(target.lm_head.device)].float()  # [Vd, H]
        self.last: dict[int, torch.Tensor] = {}  # rid -> [H] h_u of the last verified token

    @classmethod
    def from_target(cls, target, path: str | os.PathLike | None = None) -> "MedusaDrafter":
        ckpt = Path(path) if path else default_checkpoint(target)
        return cls(target.model, load_medusa(ckpt, target.cfg))

    # --- lifecycle ----------------------------------------------------------------------------
    def add_request(self, rid: int, capture: TargetCapture) -> None:
        self.commit(rid, capture)

    @torch.inference_mode()
    def commit(self, rid: int, capture: TargetCapture) -> None:
        h = capture.hidden.get(self.last_layer)
        if h is None or h.shape[0] == 0:
            raise DrafterError(f"target capture lacks the output of layer {self.last_layer}")
        self.last[rid] = rms_norm(h[-1:].float(), self.target.norm.float(), self.target.cfg.rms_norm_eps)[0]

    def remove_request(self, rid: int) -> None:
        self.last.pop(rid, None)

    # --- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def head_probs(self, rids: list[int], finite: Finite | None = None) -> torch.Tensor:
        """[b, K, Vd] each head's probabilities over the draft vocab for each request; `finite` (if
        given) collects whether the heads' logits were finite."""
        missing = [r for r in rids if r not in self.last]
        if missing:
            raise DrafterError(f"requests {missing} have no verified hidden state")
        logits = self.heads.logits(torch.stack([self.last[r] for r in rids]), self.lm_rows)
        if finite is not None:
            finite.check(logits)
        return torch.softmax(logits, dim=-1)

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        depth = min(shape.depth, self.heads.cfg.num_heads)
        finite = Finite()
        probs = self.head_probs([d.rid for d in batch], finite)[:, :depth]  # [b, D, Vd]
        top_p, top_i = probs.topk(min(shape.topk, probs.shape[-1]), dim=-1)  # [b, D, k]
        roots = to_device(torch.tensor([d.token_ids[-1] for d in batch]), top_p.device)
        trees = head_trees(
            top_p, self.hot_ids[top_i], roots, [d.seq_len for d in batch], shape.num_draft_tokens, shape.min_prob
        )
        for t in trees:
            t.finite = finite.flag
        return trees


def head_trees(
    top_p: torch.Tensor,  # [b, D, k] each head's top-k probabilities, best first
    top_ids: torch.Tensor,  # [b, D, k] their target ids
    roots: torch.Tensor,  # [b] each request's root token
    seq_lens: list[int],
    num_draft_tokens: int,
    min_prob: float = 0.0,
    drop: bool | None = None,
) -> list[TokenTree]:
    """The trees for a batch, on top_p's device without reading it: every candidate node
    (k + k^2 + ... + k^D of them, depth-major: node m of depth t+1 is child m % k of node m // k of
    depth t) is scored at once, and the num_draft_tokens-1 best are the tree (a child never outscores
    its parent, so they are closed under parents up to exact ties, whose orphans stay unverified).
    Nodes below min_prob (or of probability 0) are left out or kept unlinked (trees_from_candidates)."""
    b, depth, k = top_p.shape
    dev = top_p.device
    scores, tokens, parents = [], [], []
    prev = top_p.new_ones(b, 1)
    start = 0  # flat index where the previous depth's candidates begin (-1: the root)
    for t in range(depth):
        level = (prev[:, :, None] * top_p[:, t, None, :]).reshape(b, -1)  # [b, k^(t+1)]
        scores.append(level)
        tokens.append(top_ids[:, t].repeat(1, level.shape[1] // k))
        ar = torch.arange(level.shape[1], device=dev)
        parents.append(ar // k + start if t else torch.full_like(ar, -1))
        start += prev.shape[1] if t else 0
        prev = level
    flat_s, flat_t, flat_p = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents)
    top = torch.topk(flat_s, min(num_draft_tokens - 1, flat_s.shape[1]), dim=-1).indices.sort(dim=-1).values
    node_s, node_t = torch.gather(flat_s, 1, top), torch.gather(flat_t, 1, top)
    keep = (node_s >= min_prob) & (node_s > 0)
    return trees_from_candidates(roots, top, node_t, node_s, flat_p[top], seq_lens, keep, drop)
