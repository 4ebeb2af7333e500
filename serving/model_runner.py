"""The model runner: one target forward over a step's rows (nano-vllm's and SGLang's model_runner, vLLM's
gpu_model_runner): input assembly (token ids, positions, the slots each row writes, the attention plan over the
slots each row reads), a replay of a captured graph when the step's shape fits a bucket, else the eager
forward, and the logits of the rows that need them.

What to run (ForwardBatch, from the engine's step): the decoding requests' token trees, then the arrivals'
prompt chunks, each with the new KV slots its rows write:

    rows:    [ tree 0 | tree 1 | ... | chunk 0 | chunk 1 ]      T tree rows, then the chunks' prompt tokens
    reads:   each tree: its request's committed slots + its own nodes (ancestors only: the tree mask)
             each chunk: its request's slots so far + its own tokens (causal)
    logits:  every tree row, then the last row of each prompt done by this chunk (one lm_head matmul)

Device rule: everything here runs on the target's device and reads nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ext.attention import causal_mask, plan_attention, prefix_and_tree_mask
from sglang_ext.device import Stream, to_device, upload
from sglang_ext.models.decode_graphs import decode
from sglang_ext.models.graph_runner import GraphRunner
from sglang_ext.tree import TokenTree
from sglang_ext.verify import GreedyRows

from .kv_manager import KVManager
from .request import Request


@dataclass
class ForwardBatch:
    """One target forward: the decoding requests' trees and the arrivals' prompt chunks, with their new slots."""

    reqs: list[Request]  # the decoding requests, one tree each
    trees: list[TokenTree]  # on the target's device, tree i for reqs[i]
    tree_slots: torch.Tensor  # [T] int64 host ids: every tree's new slots, tree after tree
    node_slots: tuple[torch.Tensor, ...]  # per tree, its view of tree_slots [n_i]
    chunks: list[tuple[Request, int]]  # (request, end): its prompt tokens [r.prefilled, end) run now
    chunk_slots: list[torch.Tensor]  # per chunk, its tokens' new slots [end - r.prefilled] int64 host ids
    # a replayed verify's logits, argmax and greedy paths, taken inside its graph (forward sets it; None: eager)
    greedy: GreedyRows | None = None

    @property
    def tree_rows(self) -> int:
        return len(self.tree_slots)


class ModelRunner:
    """Runs the target over a ForwardBatch; `graph_runner` replays steps without prompt rows whose shape fits a
    bucket (CUDA graphs; None: always eager, the CPU's case)."""

    def __init__(self, model, kv: KVManager, capture_layers: tuple[int, ...] = (), cuda_graphs: bool = False):
        self.model, self.kv, self.capture_layers = model, kv, capture_layers
        use_graphs = cuda_graphs and model.device.type == "cuda"
        self.graph_runner = GraphRunner(model, capture_layers) if use_graphs else None

    def forward(self, batch: ForwardBatch):
        """The step's one target forward: K/V written at the batch's new slots, the captured layers kept beside
        the prefix cache (KVManager.store_hidden). -> the model's output (hidden [R, H], captured {layer: [R, H]})."""
        ids = [t.draft_tokens for t in batch.trees]
        pos = [t.positions for t in batch.trees]
        slots = list(batch.node_slots)
        chunk_masks = []
        for (r, end), s in zip(batch.chunks, batch.chunk_slots):
            ids.append(torch.tensor(r.prompt_ids[r.prefilled : end]))
            pos.append(torch.arange(r.prefilled, end))
            slots.append(s)
            chunk_masks.append(causal_mask(end - r.prefilled, r.prefilled))
        reqs, g = batch.reqs, self.graph_runner
        sizes = [t.num_nodes for t in batch.trees]
        if g is not None and not batch.chunks and g.can_run(sizes, [len(r.slots) for r in reqs]):
            masks = [t.tree_mask for t in batch.trees]
            keys = [r.rid for r in reqs]
            out, batch.greedy = g.run(ids, pos, slots, [r.slots for r in reqs], masks, self.kv.pool, keys, batch.trees)
        else:
            masks = [prefix_and_tree_mask(t.tree_mask, len(r.slots)) for r, t in zip(reqs, batch.trees)] + chunk_masks
            prefixes = [r.slots for r in reqs] + [r.slots for r, _ in batch.chunks]
            out = self.forward_rows(ids, pos, slots, prefixes, masks)
        self.kv.store_hidden(slots, out.captured)
        return out

    def can_decode(self, reqs: list[Request]) -> bool:
        """Whether a plain decode step of these requests (one row each) replays a graph (`decode`)."""
        g = self.graph_runner
        return g is not None and g.can_run([1] * len(reqs), [len(r.slots) for r in reqs])

    def decode(
        self,
        reqs: list[Request],
        slots: torch.Tensor,
        tokens: list[int] | None = None,
        penalties=None,
        sampling=None,
        top: int | None = None,
    ):
        """A plain decode step (slots [B] int64 host ids: each request's new slot): one row per request reading
        `tokens` (default: each request's last output token; -1 - i: row i's token of the previous decode step, still
        on the device: models/decode_graphs.py), the logits and each row's token inside the graph -> [B] int64
        tokens on the device (queue their copy to the host before the next forward). penalties: per request its
        logits rules (Sampler.penalty_row), or None: every row's logits the raw ones; sampling: per request its
        parameters (Sampler.graph_sampling), or None: every row's token the argmax; top: K, each row's logprobs and
        its K likeliest with its token ([B, 2 + 2K]: models/decode_graphs.py), or None: none."""
        if tokens is None:
            tokens = [r.output_ids[-1] for r in reqs]
        keys, prefixes = [r.rid for r in reqs], [r.slots for r in reqs]
        return decode(self.graph_runner, keys, tokens, slots, prefixes, self.kv.pool, penalties, sampling, top)

    @property
    def stream(self) -> Stream | None:
        """Where the replayed steps' device work goes (None without a graph runner: every step eager)."""
        return self.graph_runner.stream if self.graph_runner is not None else None

    def release(self, r: Request) -> None:
        """The request ended: the graph runner's slot table forgets it."""
        if self.graph_runner is not None:
            self.graph_runner.forget(r.rid)

    def forward_rows(
        self,
        ids: list[torch.Tensor],  # per group [n_b] token ids
        positions: list[torch.Tensor],  # per group [n_b]
        slots: list[torch.Tensor],  # per group [n_b] host ids: where its rows' K/V is written
        prefixes: list[torch.Tensor],  # per group [P_b] host ids: the committed slots its rows read first
        masks: list[torch.Tensor],  # per group [n_b, P_b + n_b] bool: row j sees column i
    ):
        """The eager forward over groups of rows (a tree, a prompt chunk, an edge session's tokens), each reading
        its prefix and its own rows. NOTE: a faulty drafter's token outside the vocabulary must not index past
        the embedding (on a GPU, a device-side assert): ids are clamped; verification never accepts it (the
        graph runner clamps inside its replay)."""
        dev = self.model.device
        # each group's [prefix | new] slots: one cat for the batch, a view per group
        kv_all = torch.cat([x for p, s in zip(prefixes, slots) for x in (p, s)])
        kv_lists = kv_all.split([len(p) + len(s) for p, s in zip(prefixes, slots)])
        k = len(ids)
        placed = upload(ids + positions + masks, dev)  # the prompts' ids and masks: one copy per dtype
        ids, positions, masks = placed[:k], placed[k : 2 * k], placed[2 * k :]
        top = self.model.cfg.vocab_size - 1
        return self.model.forward(
            torch.cat(ids).clamp_(0, top),
            torch.cat(positions),
            to_device(torch.cat(slots), dev),
            plan_attention(kv_lists, masks, device=dev),
            self.kv.pool,
            self.capture_layers,
        )

    def logits(self, hidden: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        return self.model.logits(hidden, fp32=fp32)

    def step_logits(self, out, batch: ForwardBatch) -> torch.Tensor:
        """[T + D, V]: one lm_head matmul for the step: every tree row, and the last row of each prompt done now
        (D of them; none when only chunks of unfinished prompts ran: an empty [0, 0])."""
        if batch.greedy is not None:  # (taken inside the verify's graph: no chunks there)
            return batch.greedy.logits
        hidden, tree_rows = out.hidden, batch.tree_rows
        if batch.chunks:  # (not on plain decode steps)
            sizes = [end - r.prefilled for r, end in batch.chunks]
            ends = torch.tensor(sizes, dtype=torch.long).cumsum(0) - 1 + tree_rows
            done = [i for i, (r, end) in enumerate(batch.chunks) if end == len(r.prompt_ids)]
            hidden = hidden[to_device(torch.cat([torch.arange(tree_rows), ends[done]]), hidden.device)]
        return self.model.logits(hidden, fp32=False) if hidden.shape[0] else hidden.new_empty(0, 0)
