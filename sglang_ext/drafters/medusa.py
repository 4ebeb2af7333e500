"""Medusa-1 drafter: K heads over the target's last hidden state, one tree per step from their top-k.

State. A request keeps one vector: the target's final-norm'd hidden state at its last verified token
u (the output of the last layer, captured, through the target's final norm). The root (token u+1,
the bonus or the prompt's next token) is what the target verifies next; head k predicts token
u+k+2, i.e. tree depth k+1 (models/medusa.py). Heads never see the tree's tokens, so one forward of
K small heads per request drafts the whole tree.

Tree. Head d's top-k (d = 0..depth-1) are the candidates at depth d+1 under every node of depth d;
a node's score is the product of its path's head probabilities. The tree is the num_draft_tokens-1
best nodes by score, found best-first from the root (a node enters only after its parent, so the set
is closed under parents; a child never outscores its parent), within TreeShape's depth (at most K),
topk (children per node) and min_prob (no node of lower score). This is our dynamic search with
Medusa's independence assumption; the paper's fixed sparse tree is the same rule applied offline to
accuracies measured on a calibration set, while the per-step search adapts to how confident the
heads are for this request (a confident step gets a deep chain, an unsure one a wide first level).

Proposals are deterministic (top-k), so trees carry no draft_probs: the verifier treats them as point
masses, which keeps speculative sampling lossless.
"""

from __future__ import annotations

import heapq
import os
from pathlib import Path

import torch

from ..models.checkpoint import CheckpointError, check_fits, has_config
from ..models.llama import LlamaModel, rms_norm
from ..models.medusa import MedusaHeads, load_medusa
from ..tree import TokenTree, TreeShape, tree_from_parents
from .base import SHIPPED_DIR, DrafterError, DraftInput, TargetCapture

SHIPPED = {"SmolLM2-135M-Instruct": SHIPPED_DIR / "smollm2-medusa"}


def default_checkpoint(target) -> Path:
    """The Medusa heads shipped in drafters/ for this target."""
    ckpt = SHIPPED.get(Path(target.path).name)
    if ckpt is None or not has_config(ckpt):
        raise CheckpointError(
            f"no shipped Medusa heads for target {target.path}; train them (moa-serve train medusa) and pass the path"
        )
    return ckpt


def best_first_tree(
    probs: list[list[float]], ids: list[list[int]], num_nodes: int, min_prob: float = 0.0
) -> tuple[list[int], list[int]]:
    """The best nodes of the tree whose depth-(d+1) children are ids[d] with probabilities probs[d].

    probs, ids: [depth][topk] per depth, best first. Returns (tokens, parents) of the non-root nodes
    in the order taken (parents index the full tree: 0 = the root, node i of the result = i + 1),
    at most num_nodes of them, each of path probability >= min_prob.
    """
    tokens: list[int] = []
    parents: list[int] = []
    # (-score, tie order, depth index d, parent node, token)
    heap = [(-p, j, 0, 0, t) for j, (p, t) in enumerate(zip(probs[0], ids[0]))]
    heapq.heapify(heap)
    order = len(heap)
    while heap and len(tokens) < num_nodes:
        neg, _, d, parent, tok = heapq.heappop(heap)
        score = -neg
        if score < min_prob or score <= 0.0:
            break  # the heap pops in decreasing score: everything left is lower
        tokens.append(tok)
        parents.append(parent)
        node = len(tokens)
        if d + 1 < len(probs):
            for p, t in zip(probs[d + 1], ids[d + 1]):
                heapq.heappush(heap, (-score * p, order, d + 1, node, t))
                order += 1
    return tokens, parents


class MedusaDrafter:
    name = "medusa"

    def __init__(self, target: LlamaModel, heads: MedusaHeads):
        check_fits(heads.cfg, target.cfg)
        self.target = target
        self.heads = heads.to(target.device, torch.float32).eval()
        self.last_layer = target.cfg.num_layers - 1
        self.capture_layers = (self.last_layer,)  # its output, through the target's final norm = h_u
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
    def head_probs(self, rids: list[int]) -> torch.Tensor:
        """[b, K, Vd] each head's probabilities over the draft vocab for each request."""
        missing = [r for r in rids if r not in self.last]
        if missing:
            raise DrafterError(f"requests {missing} have no verified hidden state")
        logits = self.heads.logits(torch.stack([self.last[r] for r in rids]), self.lm_rows)
        if not torch.isfinite(logits).all():
            raise DrafterError("Medusa heads produced non-finite logits")
        return torch.softmax(logits, dim=-1)

    @torch.inference_mode()
    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        depth = min(shape.depth, self.heads.cfg.num_heads)
        probs = self.head_probs([d.rid for d in batch])[:, :depth]  # [b, D, Vd]
        top_p, top_i = probs.topk(min(shape.topk, probs.shape[-1]), dim=-1)  # [b, D, k]
        top_ids = self.hot_ids[top_i]  # target ids
        trees = []
        for i, d in enumerate(batch):
            tokens, parents = best_first_tree(
                top_p[i].tolist(), top_ids[i].tolist(), shape.num_draft_tokens - 1, shape.min_prob
            )
            trees.append(
                tree_from_parents(
                    torch.tensor([d.token_ids[-1], *tokens], dtype=torch.long),
                    torch.tensor([-1, *parents], dtype=torch.long),
                    d.seq_len,
                )
            )
        return trees
