"""Draft-model drafter: a smaller model sharing the target's tokenizer, no training needed.

By default a LayerSkip-style self-draft: the target's first layers plus its last layers (the
middle is skipped), with the target's own embedding, final norm and lm_head; weights are shared
with the target, not copied. The drafter keeps its own KV cache; tokens are added to it lazily
(at the next propose) once verified, so rejected drafts never enter it. Its K/V of a token depends only on the
tokens up to it: it is kept beside the engine's prefix cache under the token's target slot (drafters/kept.py), and
a hit processes only its new tokens.
"""

from __future__ import annotations

import torch

from ..attention import FrontierPaths, causal_mask, plan_attention, plan_frontier
from ..device import upload
from ..models.draft_graphs import FrontierRunner
from ..models.graph_runner import with_static_attention
from ..models.llama import LlamaModel
from ..tree import TokenTree, TreeShape
from .base import Drafter, DraftInput, TargetCapture
from .kept import KeptState, keep_or_free
from .search import search_tree


def default_self_draft_layers(num_layers: int) -> list[int]:
    first = max(1, num_layers // 4)
    return list(range(first)) + list(range(num_layers - 2, num_layers))


class DraftModelDrafter(Drafter):
    name = "draft-model"
    keeps_prefix_state = True  # the K/V of prefix-cached tokens, by target slot (release_request, drop_prefix)
    captures_steps = True

    def __init__(self, model: LlamaModel, num_slots: int = 16384):
        self.model = model
        self.kv = model.new_kv_pool(num_slots)
        self.slots: dict[int, torch.Tensor] = {}  # draft-KV slots of the tokens already processed
        self.borrowed: dict[int, int] = {}  # leading tokens whose slots were adopted from the kept state
        self.kept = KeptState((self.kv,))  # K/V of prefix-cached tokens, by target slot
        # search steps at bucketed static shapes (CUDA graphs on CUDA); the engine turns this on with its
        # cuda_graphs setting
        self.step_graphs = False
        self._steps: FrontierRunner | None = None

    @classmethod
    def self_draft(
        cls, target: LlamaModel, layers: list[int] | None = None, num_slots: int = 16384
    ) -> "DraftModelDrafter":
        return cls(target.subset(layers or default_self_draft_layers(len(target.layers))), num_slots)

    def add_request(self, rid: int, capture: TargetCapture) -> None:
        (self.slots[rid],) = self.kept.adopt(capture.slots[: capture.cached])
        self.borrowed[rid] = self.slots[rid].numel()

    def commit(self, rid: int, capture: TargetCapture) -> None:
        pass

    def remove_request(self, rid: int) -> None:
        self.kv.free(self.slots.pop(rid, torch.empty(0, dtype=torch.long))[self.borrowed.pop(rid, 0) :])

    def release_request(self, rid: int, taken: torch.Tensor) -> None:
        """The request ended; taken[i]: the target slot where the prefix cache holds its token i, or -1. The K/V of
        the tokens it processed that the cache holds is kept under their slots."""
        own, borrowed = self.slots.pop(rid, None), self.borrowed.pop(rid, 0)
        if own is not None:
            keep_or_free(self.kept, [own], borrowed, taken)

    def drop_prefix(self, slots: torch.Tensor) -> None:
        self.kept.drop(slots)

    def _extend(self, batch: list[DraftInput]) -> torch.Tensor:
        """Run the drafter over each request's not-yet-processed tokens; return logits after each root [b, V]."""
        ids, pos, new_slots, kv_lists, masks, last_rows = [], [], [], [], [], []
        row = 0
        for d in batch:
            done = self.slots[d.rid]
            pending = d.token_ids[done.numel() :]
            s = self.kv.alloc(len(pending))
            self.slots[d.rid] = torch.cat([done, s])
            ids += pending
            pos.append(torch.arange(done.numel(), len(d.token_ids)))
            new_slots.append(s)
            kv_lists.append(self.slots[d.rid])
            masks.append(causal_mask(len(pending), done.numel()))
            row += len(pending)
            last_rows.append(row - 1)
        dev = self.model.device
        ids, last = upload([torch.tensor(ids), torch.tensor(last_rows)], dev)  # (host values: one copy)
        plan = plan_attention(kv_lists, masks, device=dev)
        out = self.model.forward(ids, torch.cat(pos), torch.cat(new_slots), plan, self.kv)
        return self.model.logits(out.hidden[last])

    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        root_logits = self._extend(batch)
        b = len(batch)
        prefixes = [self.slots[d.rid] for d in batch]
        paths = FrontierPaths.start(b, root_logits.device)  # each frontier node's path (on the device)
        temp: list[torch.Tensor] = []

        def step_fn(tokens: torch.Tensor, parent_beam: torch.Tensor | None) -> torch.Tensor:
            nonlocal paths
            kk = tokens.shape[1]
            new = self.kv.alloc(b * kk)
            temp.append(new)
            paths = p = paths.advance(new, parent_beam)
            # every node of this step is at depth len(temp)
            pos = torch.tensor([d.seq_len + len(temp) for d in batch]).repeat_interleave(kk)
            static = self._static_step(tokens.reshape(-1), pos, new, prefixes, p) if self.step_graphs else None
            if static is not None:
                return static.view(b, kk, -1)
            plan = plan_frontier(prefixes, p.slots, p.seen)
            out = self.model.forward(tokens.reshape(-1), pos, new, plan, self.kv)
            return self.model.logits(out.hidden).view(b, kk, -1)

        try:
            return search_tree(root_logits, step_fn, shape, batch)
        finally:
            for t in temp:  # speculative draft K/V is never kept
                self.kv.free(t)

    def _static_step(self, ids, pos, slots, prefixes, paths: FrontierPaths) -> torch.Tensor | None:
        """A search step's logits [n, V] from the step runner (each node: the request's processed
        tokens + its own path), or None when its buckets do not fit (the caller runs the eager step)."""
        if self._steps is None:
            static = with_static_attention(self.model)

            def step(ids, feat, rows, plans):
                out = static.forward(ids, rows["positions"], rows["slots"], plans["draft"], self.kv)
                return (static.logits(out.hidden),)

            self._steps = FrontierRunner(step, self.model.device, self.model.cfg.max_position)
        rows = {"positions": pos, "slots": slots}
        out = self._steps.run(ids, None, rows, {"draft": (prefixes, paths.slots, paths.seen)}, (self.kv,))
        return None if out is None else out[0]
