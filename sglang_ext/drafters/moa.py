"""MoA drafter: LSA memory of verified tokens, SA + CA over it, then the target's last N layers.

Per request the drafter keeps three caches, all for verified tokens only:

    memory  CA keys/values of each verified token's LSA output   (drafter pool, ingested once)
    sa      SA keys/values of each verified token's embedding    (drafter pool, ingested once)
    target  the request's slots in the target KV pool            (read by the TLI layers, never written)

commit() queues the tokens the target just verified (root + accepted nodes); the next propose() runs LSA once
over the queued tokens of its batch (a prompt's last MEMORY_TOKENS; after drafting was off, the last few commits'
only: moa_core.catch_up).
propose() runs the tree: every node (root included) is a query at its position; its SA sees the verified prefix
plus itself (or its ancestors, per checkpoint), its CA sees all verified memory, and the TLI layers see the
target's real KV for verified positions plus the node's ancestors' speculative KV, written to temporary
target-pool slots that are freed before propose returns (the target's own cache is never written).

Prefix cache: the memory and SA K/V of a token depend only on the tokens up to it, so both are kept beside the
engine's prefix cache under its target slot (drafters/kept.py; "none" for a token without memory); a hit runs LSA
over the new tokens only (and over cached ones among the prompt's last MEMORY_TOKENS that have none).

The math (commit, the draft pass, logits, the tree driver) is moa_core's, shared with the SGLang plugin; this class
is the embedded storage: per-request slot lists and temporary tree slots.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from ..attention import FrontierPaths, frontier_fields, plan_frontier, tree_attention_cpu
from ..device import grow, module_on, to_device
from ..kernels import attach_bf16_halves, attach_packed_rows, attach_q8, attach_q8_rows, q8_moa_stacks
from ..models.checkpoint import check_fits
from ..models.draft_graphs import FrontierRunner, HeldSlots, SearchRunner
from ..models.kv_pool import KVPool
from ..models.llama import LlamaModel, rms_norm
from ..models.moa import MoADraft, load_moa
from ..models.row_graphs import RowRunner
from ..sampling import greedy_tokens
from ..settings import settings
from ..tree import TokenTree, TreeShape
from .base import Drafter, DrafterError, DraftInput, TargetCapture
from .kept import KeptState, keep_or_free
from .moa_core import (
    MEMORY_TOKENS,
    DraftKV,
    MoAParts,
    PassSlots,
    catch_up,
    commit_ca,
    commit_sa,
    draft_logits,
    draft_pass,
    draft_tree,
    lsa_memory,
    plan_fields,
)
from .moa_graphs import MoAGraphs
from .search import scatter_to_vocab, search_tree
from .shipped import shipped_path

LSA_CHUNK = 16  # tokens per native LSA call (MoADrafter._commit_q8)


def shipped_checkpoint(target, name: str) -> Path:
    """Checkpoint dir of a shipped MoA drafter ('moa': the better TLI, 'moa-tli0', 'moa-tli1');
    $MOA_SERVE_MOA overrides 'moa'."""
    return shipped_path(target, name, env=settings().moa if name == "moa" else None)


class _RequestState:
    def __init__(self):
        self.mem_slots = torch.empty(0, dtype=torch.long)  # CA K/V of verified tokens
        self.sa_slots = torch.empty(0, dtype=torch.long)  # SA K/V of verified tokens
        self.target_slots = torch.empty(0, dtype=torch.long)  # the target's slots of verified tokens (TLI reads them)
        self.pending: list[TargetCapture] = []  # verified but not yet ingested (LSA runs at the next propose)
        self.offline: list[tuple[int, int]] = []  # (sa slot, tli slot) of root + tokens drafted while disconnected
        self.borrowed = 0  # leading tokens whose SA K/V (and memory, where they have it) were adopted, kept state's
        self.borrowed_mem = 0  # of which memory slots (the first of mem_slots)
        self.holes: list[tuple[int, int]] = []  # verified tokens [a, b) without memory (moa_core.catch_up)

    def memory_of_tokens(self) -> torch.Tensor:
        """[n] each verified token's memory slot, -1 where it has none."""
        if not self.holes:
            return self.mem_slots
        has = torch.ones(self.sa_slots.numel(), dtype=torch.bool)
        for a, b in self.holes:
            has[a:b] = False
        out = torch.full(has.shape, -1, dtype=torch.long)
        out[has] = self.mem_slots
        return out


class MoADrafter(MoAGraphs, Drafter):
    keeps_prefix_state = True  # memory and SA K/V of prefix-cached tokens, by target slot
    captures_steps = True
    edge = drafts_offline = True  # an edge client gets CA K/V (+ the TLI layers' K/V); drafts on offline

    def __init__(
        self, target: LlamaModel, draft: MoADraft, num_slots: int = 32768, name: str = "moa", remote: bool = False
    ):
        """remote=True: the target runs elsewhere (edge client); verified context arrives through
        ingest_remote() and the TLI layers keep their own copy of the last N layers' K/V."""
        c = draft.cfg
        check_fits(c, target.cfg)
        if c.sa_layers != 1:
            raise DrafterError(f"{name}: the drafter runs 1 SA layer; the checkpoint has {c.sa_layers} (an ablation)")
        self.name = name
        self.target = target
        self.draft = module_on(draft, target.device, target.dtype).eval()  # beside the target
        if target.device.type == "cpu":  # (the CPU kernels' weights; a GPU runs the checkpoint's dtype)
            attach_bf16_halves(self.draft)  # a bf16 checkpoint: its matmuls read half the bytes, same sums
            if target.q8 is not None:  # beside a q8 target, on its kernels (a quarter of the bf16 bytes)
                attach_q8(self.draft)
        self.cfg = c
        self.mem = KVPool(1, num_slots, c.num_kv_heads, c.head_dim, target.dtype, target.device)
        self.sa = KVPool(1, num_slots, c.num_kv_heads, c.head_dim, target.dtype, target.device)
        self.kept = KeptState((self.mem, self.sa))  # memory and SA K/V of prefix-cached tokens, by target slot
        self.hot_ids = self.draft.hot_ids
        self.head = target.lm_head[self.hot_ids].contiguous()  # draft-vocab rows of the target's lm_head
        # and of its GGUF blocks: the same sums, ~1/4 the bytes
        attach_packed_rows(self.head, target.lm_head, self.hot_ids)
        if target.q8 is not None:
            attach_q8_rows(self.head, target.lm_head, self.hot_ids)  # those blocks on the q8 kernels
        self.tli_layers = list(range(len(target.layers) - c.tli, len(target.layers)))
        # beside a q8 target: the draft pass (SA, CA, the TLI layers, norm) in one native call, the LSA layer in
        # another, the SA commit in a third (kernels.q8_moa_stacks); None: the pieces in torch ops
        self.q8 = q8_moa_stacks(self.draft, target, self.tli_layers) if target.q8 is not None else None
        # MoA reads the target KV pool, not layer outputs (the no-LSA ablation reads the last layer's output)
        self.capture_layers: tuple[int, ...] = (len(target.layers) - 1,) if c.memory_source == "last_hidden" else ()
        self.remote = remote
        # the K/V the TLI layers read: the engine's target pool (bound at the first commit), or our own
        self.tli_kv: KVPool | None = target.new_kv_pool(num_slots, num_layers=max(1, c.tli)) if remote else None
        self.tli_offset = len(target.layers) - c.tli if remote else 0  # pool layer = target layer - offset
        self.reqs: dict[int, _RequestState] = {}
        self.lsa_rows = 0  # tokens LSA has processed (each verified token at most once)
        self.kv = DraftKV(self.sa.k[0], self.sa.v[0], self.mem.k[0], self.mem.v[0])
        self.parts = MoAParts(
            draft=self.draft,
            embed=target.embed,
            head=self.head,
            hot_ids=self.hot_ids,
            final_norm=lambda x: rms_norm(x, target.norm, target.cfg.rms_norm_eps),
            tli_layers=[self._tli_layer(li) for li in self.tli_layers],
            attention=tree_attention_cpu,
        )
        # draft passes at bucketed static shapes (CUDA graphs on CUDA); the engine turns this on with its
        # cuda_graphs setting. Deterministic searches only: sampled chains need full-vocab logits.
        self.step_graphs = False
        self._steps: FrontierRunner | None = None
        self._search: SearchRunner | None = None  # the whole search in one static function (one graph)
        self._held: HeldSlots | None = None  # its temporary SA slots, held for good
        self._static: MoAParts | None = None  # the parts with static attention (what the runners run)
        self._commits: RowRunner | None = None  # the queued tokens' LSA, CA and SA commits in one graph

    def _tli_layer(self, li: int, target: LlamaModel | None = None):
        """Target layer li over the draft feature: reads and writes the K/V of tli_kv (bound at the first
        commit); target: the model whose layer runs (the target, or its static-attention copy)."""
        target = target or self.target

        def run(x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, plan) -> torch.Tensor:
            rope = target.rope(positions)
            return target.layer_forward(li, x, rope, slots, plan, self.tli_kv, kv_layer=li - self.tli_offset)

        return run

    @classmethod
    def from_target(cls, target, path: str | os.PathLike | None = None, name: str = "moa") -> "MoADrafter":
        ckpt = Path(path) if path else shipped_checkpoint(target, name)
        return cls(target.model, load_moa(ckpt, target.cfg, dtype=target.model.dtype), name=name)

    # --- lifecycle ----------------------------------------------------------------------------
    def add_request(self, rid: int, capture: TargetCapture) -> None:
        st = self.reqs[rid] = _RequestState()
        if capture.cached and not self.remote:
            mem, sa = self.kept.adopt(capture.slots[: capture.cached])
            n = _adoptable(mem, capture.slots.numel())
            has = mem[:n] >= 0
            st.mem_slots, st.sa_slots, st.target_slots = mem[:n][has], sa[:n], capture.slots[:n]
            st.holes = _runs(~has)
            st.borrowed, st.borrowed_mem = n, st.mem_slots.numel()
            hidden = capture.hidden
            if self.capture_layers and n < capture.cached:  # (the no-LSA ablation's memory: cached tokens' outputs)
                if capture.cached_hidden is None:
                    raise DrafterError("a prefix cache hit without the captured layers of its cached tokens")
                older = capture.cached_hidden(n)
                hidden = {l: torch.cat([older[l], h]) for l, h in hidden.items()}
            capture = replace(capture, token_ids=capture.token_ids[n:], positions=capture.positions[n:], hidden=hidden)
            capture = replace(capture, slots=capture.slots[n:], cached=0, cached_hidden=None)
        self.commit(rid, capture)

    @torch.inference_mode()
    def commit(self, rid: int, capture: TargetCapture) -> None:
        if capture.kv is None:
            raise DrafterError("MoA needs the target KV pool in TargetCapture.kv")
        if self.tli_kv is not capture.kv:
            # a new pool (another engine, or an engine's reset after a fault rebuilt its pool) binds the
            # drafter once no live request reads the old one; its step graphs are recaptured for it
            if self.tli_kv is not None and set(self.reqs) != {rid}:
                raise DrafterError("MoA drafter bound to a different target KV pool (its requests are live)")
            self.tli_kv = capture.kv
        if capture.slots.numel():
            # NOTE: deferred to the next propose, where the batch's queued tokens go through LSA in one call: while
            # adaptive speculation is off, commits cost nothing, and a catch-up is bounded (moa_core.catch_up)
            self.reqs[rid].pending.append(capture)

    def _flush(self, batch: list[DraftInput]) -> None:
        """Ingest the queued verified tokens of these requests: one LSA call, one SA commit, one write per pool."""
        sts = [self.reqs[d.rid] for d in batch]
        caps = [c for st in sts for c in st.pending]
        if not caps:
            return
        hidden = {l: torch.cat([c.hidden[l] for c in caps]) for l in self.capture_layers}
        positions = torch.cat([c.positions for c in caps])
        target_slots = torch.cat([c.slots for c in caps])
        sizes = [sum(c.slots.numel() for c in st.pending) for st in sts]
        holes, keep = catch_up([[c.slots.numel() for c in st.pending] for st in sts])
        if hidden:  # (memory from the captured layers, not LSA: every token's)
            holes, keep = [(0, 0)] * len(sts), None
        at = (target_slots, positions)
        if keep is not None:  # (uploaded: a host index into a device tensor makes the host wait for the device)
            at = tuple(t[to_device(keep, t.device)] for t in at)
        k, v = self.context(caps[0].kv, *at, hidden)
        tokens = [t for c in caps for t in c.token_ids]
        self._ingest(sts, sizes, tokens, positions, k, v, target_slots, holes)
        for st in sts:
            st.pending = []

    def context(self, kv: KVPool, slots: torch.Tensor, positions: torch.Tensor, hidden: dict | None = None):
        """CA keys/values of newly verified tokens: LSA over their K/V at every target layer (or,
        for the no-LSA ablation, their last-layer output). Also what an edge server sends a client."""
        if self.capture_layers:
            return commit_ca(self.draft, (hidden or {})[self.capture_layers[0]], positions)
        self.lsa_rows += slots.numel()
        if self.q8 is not None:
            return self._commit_q8(kv, slots, positions)
        return commit_ca(self.draft, lsa_memory(self.draft, kv.k, kv.v, slots), positions)

    def _ingest(
        self,
        sts: list[_RequestState],
        sizes: list[int],  # new tokens per request, in order
        token_ids: list[int],  # [n] every request's new tokens, request after request
        positions: torch.Tensor,  # [n]
        ca_k: torch.Tensor,  # [n, kv_heads, D]
        ca_v: torch.Tensor,
        target_slots: torch.Tensor,  # [n] the tokens' target slots
        holes: list[tuple[int, int]] | None = None,  # per request, its tokens [a, b) without memory (CA K/V)
    ) -> None:
        """Store newly verified tokens' CA K/V (ca_k / ca_v: every token's but the holes') and commit their SA K/V: one
        allocation, one SA commit and one write per pool for all; each request's slot lists grow by its share."""
        n = len(token_ids)
        mem = self.mem.alloc(ca_k.shape[0])
        self.mem.write(0, mem, ca_k, ca_v)
        ids = to_device(torch.as_tensor(token_ids), ca_k.device)
        sa = self.sa.alloc(n)
        if self.q8 is not None:  # the SA layer's norm, k|v, RoPE and K/V store in one call (no q: nothing reads it)
            cos, sin = self.target.rope(positions)
            self.q8[0].layer_kv(self.target.embed[ids], 0, cos[:, 0], sin[:, 0], self.sa.k[0], self.sa.v[0], sa)
        else:
            k, v = commit_sa(self.draft, self.target.embed, ids, positions)
            self.sa.write(0, sa, k, v)
        holes = holes or [(0, 0)] * len(sts)
        for st, (a, b) in zip(sts, holes):
            if b > a:
                at = st.sa_slots.numel()
                st.holes.append((at + a, at + b))
        got = [k - (b - a) for k, (a, b) in zip(sizes, holes)]  # memory slots: none for a catch-up's hole
        new = [x for add in zip(mem.split(got), sa.split(sizes), target_slots.split(sizes)) for x in add]
        parts = iter(grow([x for st in sts for x in (st.mem_slots, st.sa_slots, st.target_slots)], new))
        for st in sts:
            st.mem_slots, st.sa_slots, st.target_slots = next(parts), next(parts), next(parts)

    def _commit_q8(self, kv: KVPool, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """lsa_memory then commit_ca in one native call on the LSA stack (Q8Stack.lsa_commit): each token's L rows
        (its K|V at every target layer, RoPE over the layer index) attend to each other; mean over L, Ekv2E, the CA
        keys (RoPE at positions [n]) and values [n, kv_heads, D]. A prompt's tokens go LSA_CHUNK at a time: a
        call's buffers are L rows a token, and past a few dozen tokens they outgrow the caches (2x the time a token)."""
        layers = len(kv.k)
        lsa_cos, lsa_sin = self.draft._lsa_rope(layers, torch.float32, kv.k[0].device)  # [L, 1, d]
        cos, sin = self.draft.rope(positions, torch.float32)  # [n, 1, D]
        lc, ls, cos, sin = lsa_cos[:, 0], lsa_sin[:, 0], cos[:, 0], sin[:, 0]
        if slots.numel() <= LSA_CHUNK:
            return tuple(self.q8[1].lsa_commit(kv.k, kv.v, slots, lc, ls, cos, sin))
        parts = [
            self.q8[1].lsa_commit(
                kv.k, kv.v, slots[i : i + LSA_CHUNK], lc, ls, cos[i : i + LSA_CHUNK], sin[i : i + LSA_CHUNK]
            )
            for i in range(0, slots.numel(), LSA_CHUNK)
        ]
        return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    def _pass_q8(self, tokens: torch.Tensor, at: PassSlots, full: bool) -> torch.Tensor:
        """draft_pass + draft_logits on the draft-pass stack: SA, CA and the TLI layers in one call, each with its
        own plan, pools and K/V rows (CA writes none); then the head rows -> logits [n, Vd] (or [n, V] when full)."""
        cos, sin = self.target.rope(at.positions)
        sa, ca = frontier_fields(*at.specs["sa"]), frontier_fields(*at.specs["ca"])
        layers = [(at.sa_slots, self.sa.k[0], self.sa.v[0], sa), (at.sa_slots, self.mem.k[0], self.mem.v[0], ca)]
        if self.tli_layers:
            tli = frontier_fields(*at.specs["tli"])
        for li in self.tli_layers:
            j = li - self.tli_offset
            layers.append((at.tli_slots, self.tli_kv.k[j], self.tli_kv.v[j], tli))
        slots, kp, vp, plans = zip(*layers)
        zero = torch.zeros_like(at.sa_slots)  # (CA writes no K/V)
        flat = [t for p in plans for t in p]
        stack = self.q8[0]
        h = stack.forward_layers(
            self.target.embed[tokens],
            cos[:, 0],
            sin[:, 0],
            [slots[0], zero, *slots[2:]],
            list(kp),
            list(vp),
            list(range(len(layers))),
            flat,
            self.draft.scale,
            [],
        )[0]
        logits = stack.logits(h)
        return scatter_to_vocab(logits, self.hot_ids, self.cfg.vocab_size) if full else logits

    @property
    def catches_up(self) -> bool:
        # a verified token's memory and SA K/V come from the target's pool and its id alone (the no-LSA ablation's
        # memory reads captured layer outputs; an edge client's context arrives from its server)
        return not self.remote and not self.capture_layers

    def _take_missed(self, batch: list[DraftInput]) -> None:
        """Queue each request's tokens that no commit brought (the engine's off steps: `catches_up`), from its
        DraftInput: one capture of them, as their commits would have queued (moa_core.catch_up counts tokens)."""
        for d in batch:
            st = self.reqs[d.rid]
            seen = st.target_slots.numel() + sum(c.slots.numel() for c in st.pending)
            if d.slots is None or seen >= d.seq_len:
                continue
            positions = torch.arange(seen, d.seq_len, device=d.slots.device)
            missed = TargetCapture(d.token_ids[seen : d.seq_len], positions, d.slots[seen : d.seq_len], kv=self.tli_kv)
            st.pending.append(missed)

    @property
    def edge_client_ready(self) -> bool:
        return self.remote  # the TLI layers keep their own copy of the target's K/V

    def for_edge_client(self) -> "MoADrafter":
        return self if self.remote else MoADrafter(self.target, self.draft, name=self.name, remote=True)

    def edge_context(self, kv: KVPool, slots, positions, hidden: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """CA K/V of the verified tokens and, for TLI > 0, their K/V at the TLI layers [N, n, kv, D]."""
        k, v = self.context(kv, slots, positions, hidden)
        ctx = {"ca_k": k, "ca_v": v}
        if self.tli_layers:
            ctx["tli_k"] = torch.stack([kv.k[l][slots] for l in self.tli_layers])
            ctx["tli_v"] = torch.stack([kv.v[l][slots] for l in self.tli_layers])
        return ctx

    def ingest_context(self, rid: int, tokens: list[int], positions: torch.Tensor, ctx: dict) -> None:
        self.ingest_remote(rid, tokens, positions, ctx["ca_k"], ctx["ca_v"], ctx.get("tli_k"), ctx.get("tli_v"))

    @torch.inference_mode()
    def ingest_remote(
        self, rid: int, token_ids: list[int], positions: torch.Tensor, ca_k, ca_v, tli_k=None, tli_v=None
    ) -> None:
        """Edge client: verified tokens' CA K/V (and, for TLI > 0, the target's last-N-layer K/V
        [N, n, kv, D]) as computed by the server."""
        if not self.remote:
            raise RuntimeError("ingest_remote needs a drafter built with remote=True")
        st = self.reqs.setdefault(rid, _RequestState())
        self.drop_offline(rid)
        n = len(token_ids)
        dt = self.target.dtype
        if self.tli_layers:
            slots = self.tli_kv.alloc(n)
            for j in range(len(self.tli_layers)):
                self.tli_kv.write(j, slots, tli_k[j].to(dt), tli_v[j].to(dt))
        else:
            slots = torch.zeros(n, dtype=torch.long)  # TLI=0 reads no target K/V
        self._ingest([st], [n], token_ids, positions, ca_k.to(dt), ca_v.to(dt), slots)

    @torch.inference_mode()
    def offline_next(self, rid: int, token_ids: list[int]) -> int:
        """Disconnected: greedy next token after token_ids (verified + root + tokens drafted offline),
        continuing the offline chain whose speculative K/V is kept until drop_offline()."""
        st = self.reqs[rid]
        seq_len = st.target_slots.numel()
        depth = len(token_ids) - 1 - seq_len  # 0 = the root
        if depth != len(st.offline):
            raise DrafterError(f"request {rid}: offline chain out of sync ({len(st.offline)} vs {depth})")
        sa_new = self.sa.alloc(1)
        tgt_new = self.tli_kv.alloc(1) if self.tli_layers else torch.zeros(1, dtype=torch.long)
        st.offline.append((int(sa_new), int(tgt_new)))
        own = st.offline if self.cfg.sa_tree_attention == "ancestors" else st.offline[-1:]
        sa_plan = plan_frontier(
            [st.sa_slots], torch.tensor([[s for s, _ in own]]), torch.ones(1, 1, len(own), dtype=torch.bool)
        )
        ca_plan = plan_frontier(
            [st.mem_slots], torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 1, 0, dtype=torch.bool)
        )
        tli_plan = None
        if self.tli_layers:
            path = torch.tensor([[t for _, t in st.offline]])
            tli_plan = plan_frontier([st.target_slots], path, torch.ones(1, 1, path.shape[1], dtype=torch.bool))
        at = PassSlots(torch.tensor([seq_len + depth]), sa_new, tgt_new, sa_plan, ca_plan, tli_plan)
        h = draft_pass(self.parts, self.kv, torch.tensor(token_ids[-1:]), at)
        return int(self.hot_ids[greedy_tokens(self._to_logits(h, False))[0]])

    def drop_offline(self, rid: int) -> None:
        st = self.reqs.get(rid)
        if st is None or not st.offline:
            return
        self.sa.free(torch.tensor([s for s, _ in st.offline]))
        if self.tli_layers:
            self.tli_kv.free(torch.tensor([t for _, t in st.offline]))
        st.offline = []

    def remove_request(self, rid: int) -> None:
        self._forget_static(rid)
        self.drop_offline(rid)
        st = self.reqs.pop(rid, None)
        if st is not None:
            self.mem.free(st.mem_slots[st.borrowed_mem :])
            self.sa.free(st.sa_slots[st.borrowed :])
            if self.remote and self.tli_layers:
                self.tli_kv.free(st.target_slots)

    def release_request(self, rid: int, taken: torch.Tensor) -> None:
        """The request ended; taken[i]: the target slot where the prefix cache holds its token i, or -1. The memory
        and SA K/V of the tokens it ingested that the cache holds are kept under their slots."""
        st = self.reqs.get(rid)
        if st is None or self.remote:
            self.remove_request(rid)
            return
        self._forget_static(rid)
        self.drop_offline(rid)
        del self.reqs[rid]
        keep_or_free(self.kept, [st.memory_of_tokens(), st.sa_slots], st.borrowed, taken)

    def drop_prefix(self, slots: torch.Tensor) -> None:
        self.kept.drop(slots)

    # --- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        self._take_missed(batch)
        # (a static commit is prepared here and runs in the search's graph, or alone below; else _flush runs now)
        commit = self._static_commit(batch) if self.step_graphs else self._flush(batch)
        for d in batch:
            st = self.reqs[d.rid]
            if st.target_slots.numel() != d.seq_len:
                raise DrafterError(
                    f"request {d.rid}: draft state out of sync ({st.target_slots.numel()} verified vs {d.seq_len})"
                )
        full = shape.topk == 1 and any(not d.params.greedy for d in batch)
        static = self.step_graphs and not full
        # the whole search as one graph replay; on the CPU with min_prob the eager search stops early and
        # drops the nodes below it (trees of other sizes than a static search's), so it runs pass by pass
        if static and (not shape.min_prob or self.target.device.type != "cpu"):
            trees = self._static_search(batch, shape, commit)  # (the commit and the search in one graph)
            if trees is not None:
                return trees
        if commit is not None:  # (no search ran it)
            self._run_commit(commit)
        paths = _TreePaths(self, batch, plans=not static and self.q8 is None)
        try:
            trees = draft_tree(
                self.parts,
                self.kv,
                paths,
                to_device(torch.tensor([d.token_ids[-1] for d in batch]), self.target.device),
                lambda root_logits, step_fn: search_tree(root_logits, step_fn, shape, batch),
                full,
                logits=lambda h: self._to_logits(h, full),
                run_pass=self._static_pass if static else self._native_pass(full),
            )
        finally:
            paths.free()  # speculative K/V is never kept
        if not full:
            for t in trees:
                t.draft_tokens = torch.cat([t.draft_tokens[:1], self.hot_ids[t.draft_tokens[1:]]])
        return trees

    def _native_pass(self, full: bool):
        """The eager pass on the q8 stacks where they run (from the plans' specs: _ragged)."""
        return None if self.q8 is None else (lambda tokens, at: self._pass_q8(tokens, at, full))

    def _to_logits(self, hidden: torch.Tensor, full: bool) -> torch.Tensor:
        return draft_logits(self.parts, hidden, full)


def _adoptable(mem: torch.Tensor, prompt: int) -> int:
    """mem [m]: the memory slots (-1: none) of a prompt's leading kept tokens -> how many to adopt. A cold run
    gives memory to the prompt's last MEMORY_TOKENS tokens (moa_core.catch_up): a kept token among them without
    memory ends the adoption (it and the rest are rebuilt with memory)."""
    start = max(0, prompt - MEMORY_TOKENS)
    missing = (mem[start:] < 0).nonzero()
    return start + int(missing[0]) if missing.numel() else mem.numel()


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """mask [n] bool -> its runs of True as [a, b) ranges."""
    edges = torch.diff(
        mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8)
    )
    return list(zip(edges.eq(1).nonzero().flatten().tolist(), edges.eq(-1).nonzero().flatten().tolist()))


class _TreePaths:
    """The embedded storage of one propose (moa_core's Frontier): each pass's nodes get temporary SA
    (and TLI) slots; a node sees its request's verified slot lists plus its path's temporary slots
    (root first), tracked on the device (FrontierPaths). The temporary slots are freed when the
    propose ends."""

    def __init__(self, drafter: MoADrafter, batch: list[DraftInput], plans: bool = True):
        """plans=False: passes carry only the plans' specs (a static pass builds its own)."""
        self.d, self.batch, self.plans = drafter, batch, plans
        self.sts = [drafter.reqs[x.rid] for x in batch]
        # each node's path over the SA slots; its TLI slots were handed out alongside, pass for pass, so
        # the same mask reads them
        self.paths = FrontierPaths.start(len(batch), drafter.target.device)
        self.tli_slots = torch.zeros(len(batch), 0, dtype=torch.long)  # [b, E], as paths.slots
        self.passes = 0
        self.temps: list[tuple[KVPool, torch.Tensor]] = []

    def __call__(self, parent: torch.Tensor) -> PassSlots:
        """parent [b, kk]: each new node's index among the previous pass's nodes."""
        d = self.d
        b, kk = parent.shape
        sa_new = d.sa.alloc(b * kk)
        self.temps.append((d.sa, sa_new))
        tgt_new = d.tli_kv.alloc(b * kk) if d.tli_layers else torch.zeros(b * kk, dtype=torch.long)
        if d.tli_layers:
            self.temps.append((d.tli_kv, tgt_new))
        self.paths = self.paths.advance(sa_new, parent)
        if d.tli_layers:
            self.tli_slots = torch.cat([self.tli_slots, tgt_new.view(b, kk)], 1)
        # every node of this pass is at depth `passes` (the roots' pass: 0)
        pos = torch.tensor([x.seq_len + self.passes for x in self.batch]).repeat_interleave(kk)
        self.passes += 1
        sa = self.paths
        sa_seen = sa.seen if d.cfg.sa_tree_attention == "ancestors" else sa.own()
        # per request: its verified prefix gathered once for all its frontier nodes
        sts = self.sts
        specs = {
            "sa": ([st.sa_slots for st in sts], sa.slots, sa_seen),
            "ca": ([st.mem_slots for st in sts], sa.slots[:, :0], sa_seen[:, :, :0]),
        }
        if d.tli_layers:
            specs["tli"] = ([st.target_slots for st in sts], self.tli_slots, sa.seen)
        plans = {n: plan_frontier(*spec) for n, spec in specs.items()} if self.plans else {"sa": None, "ca": None}
        return PassSlots(pos, sa_new, tgt_new, **plan_fields(plans), specs=specs)

    def free(self) -> None:
        for pool, s in self.temps:
            pool.free(s)
        self.temps = []
