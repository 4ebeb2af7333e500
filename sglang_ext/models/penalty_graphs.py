"""Penalties and min_tokens inside a chained step's graph (the overlapped loop: spec_graphs.verify_spec, the plain
decode of models/decode_graphs.py), with the values the ordinary step's host path gives (serving/sampler.py:
Sampler.constrained; sglang_ext/penalties.py: the same penalize_rows and ban_rows, so the same bits on a device):
each node of a request's tree under the counts of its own context (the output, then its path below the root), and
the stop tokens banned at the nodes that choose an output token before number min_tokens.

A request's state lives on the device, at its row t of the graph runner's slot table (`PenaltyState`):

    counts[t]   [V] float32  its output's token counts
    lens[t]     its output's length
    prompt[t]   [V] bool     its prompt's tokens (the repetition penalty's, beside the output's)
    bias[t]     [V] float32  its logit bias
    stops[t]    [V] bool     what min_tokens bans (EOS unless ignore_eos, its stop ids)

A step's graph first adds to each tracked chained row the tokens of the step before it (the step in flight when
this one was issued, whose tokens the host has not read: a spec verify's accepted path from the futures, a plain
decode's future token), so the state holds the output up to this step's root, then penalizes. The host writes a
row (`penalty_inputs`, on the stream before the graph) when its request is tracked there and the device does not
hold its state: a chain's first step (the output all read), a request that joins a chain, a row of the table that
last held another request (the output read so far; a chained row's step in flight is then the graph's to add).
Per step the graph's inputs are each request's parameters (tracked or not, min_tokens, repetition, frequency,
presence); a request that is not tracked (its logits the raw ones) keeps its logits, upcast (exact).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..device import to_device
from ..penalties import ban_rows, bias_row, output_counts, penalize_rows, penalty_values, prompt_mask, stop_mask
from ..sampling import SamplingParams


@dataclass
class PenaltyRow:
    """What a request's logits rules read of it (serving/sampler.py: Sampler.constrained)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # the output the host has read
    stop_ids: set[int]  # what min_tokens bans


class PenaltyState:
    """The per table row state (module docstring) for a graph runner's slot table, and the host's account of it:
    owner[t], the key whose state row t holds."""

    def __init__(self, table, vocab: int, device):
        rows = table.table.shape[0]
        self.table = table
        self.counts = torch.zeros(rows, vocab, device=device)
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(rows, vocab, device=device)
        self.stops = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.owner: dict[int, Hashable] = {}

    def write(self, at: torch.Tensor, counts, lens, prompt, bias, stops) -> None:
        """Rows `at` [k] (host int64) <- host tensors [k, V] / [k] (outside a graph, on its stream)."""
        at = to_device(at, self.counts.device)
        for dst, src in zip(
            (self.counts, self.lens, self.prompt, self.bias, self.stops), (counts, lens, prompt, bias, stops)
        ):
            dst.index_copy_(0, at, to_device(src, dst.device))


def penalty_state(g) -> PenaltyState:
    """The graph runner's state for its slot table (made with it: graphs bake its addresses in)."""
    st = getattr(g, "_penalty_state", None)
    if st is None or st.table is not g._table:
        st = g._penalty_state = PenaltyState(g._table, g.model.cfg.vocab_size, g.model.device)
    return st


def penalty_inputs(
    g,
    keys: list[Hashable],
    table_rows: list[int],  # per request its row of the slot table
    chained: list[bool],  # per request: its root's token is the step in flight's, unread (the graph adds that step)
    rows: list[PenaltyRow | None],  # per request its rules, None where its logits are the raw ones
    bb: int,  # the padded batch
) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph's per-request inputs, padded to bb: ints [2, bb] (tracked, min_tokens) and floats [3, bb]
    (repetition, frequency, presence; 1, 0, 0 where untracked), after launching the writes of the tracked rows
    whose state the device does not hold (module docstring)."""
    st, vocab, fresh = penalty_state(g), g.model.cfg.vocab_size, []
    for key, t, c, row in zip(keys, table_rows, chained, rows):
        if row is None:
            if st.owner.get(t) == key:
                del st.owner[t]
            continue
        if not c or st.owner.get(t) != key:
            fresh.append((t, row))
        st.owner[t] = key
    if fresh:  # (host tensors made now: the stream may run the write after the host's lists grew)
        g.stream.launch(
            st.write,
            torch.tensor([t for t, _ in fresh], dtype=torch.long),
            torch.stack([output_counts(r.output_ids, vocab) for _, r in fresh]),
            torch.tensor([len(r.output_ids) for _, r in fresh], dtype=torch.long),
            torch.stack([prompt_mask(r.prompt_ids, vocab) for _, r in fresh]),
            torch.stack([bias_row(r.params.logit_bias, vocab) for _, r in fresh]),
            torch.stack([stop_mask(r.stop_ids, vocab) for _, r in fresh]),
        )
    pad = [None] * (bb - len(rows))
    ints = [[int(r is not None) for r in rows] + [0] * len(pad), [r.params.min_tokens if r else 0 for r in rows + pad]]
    floats = [penalty_values(r.params) if r else (1.0, 0.0, 0.0) for r in rows + pad]
    return torch.tensor(ints, dtype=torch.long), torch.tensor(floats, dtype=torch.float32).T.contiguous()


def penalty_buffers(bb: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A graph's input buffers for penalty_inputs' tensors (every row untracked)."""
    floats = torch.tensor([[1.0], [0.0], [0.0]], device=device).expand(3, bb).contiguous()
    return torch.zeros(2, bb, dtype=torch.long, device=device), floats


def penalized_logits(
    st: PenaltyState,
    inputs: tuple[torch.Tensor, torch.Tensor],  # the graph's buffers: ints [2, B], floats [3, B]
    rows: torch.Tensor,  # [B] int64 each request's table row (padding: 0, the scratch row)
    chained: torch.Tensor,  # [B] bool: the request's tokens since the host's count are `path`
    lens: torch.Tensor,  # [B] int64: how many of its path's tokens are real
    path: torch.Tensor,  # [B, W] int64 the tokens of the step before (a chained row's)
    tokens: torch.Tensor,  # [B, N] int64 the nodes' tokens, node 0 the root
    mask: torch.Tensor | None,  # [B, N, N] bool: node i sees node j (its ancestors and itself); None: N 1
    depth: torch.Tensor,  # [B, N] int64 each node's depth
    logits: torch.Tensor,  # [B * N, V]
) -> torch.Tensor:  # [B * N, V] float32
    """Inside a graph: the state brought up to each step's root, then every node's logits under its request's
    rules (a tracked request's; the others' upcast)."""
    (track, mins), (rep, freq, pres) = inputs[0], inputs[1]
    b, n = tokens.shape
    v = logits.shape[-1]
    tracked = track > 0
    add = tracked & chained
    real = add[:, None] & (torch.arange(path.shape[1], device=path.device) < lens[:, None])
    counts = st.counts.index_select(0, rows).scatter_add_(1, path.clamp(0, v - 1), real.float())
    out_len = st.lens.index_select(0, rows) + torch.where(add, lens, 0)
    keep = tracked & (rows > 0)  # (padding rows leave the scratch row as it was)
    st.counts.index_copy_(0, rows, torch.where(keep[:, None], counts, st.counts.index_select(0, rows)))
    st.lens.index_copy_(0, rows, torch.where(keep, out_len, st.lens.index_select(0, rows)))
    node_counts = counts[:, None, :].expand(b, n, v)
    if n > 1:  # each node's path below the root (as penalties.tree_output_counts)
        below = tokens[:, None, 1:].clamp(0, v - 1).expand(b, n, n - 1)
        node_counts = node_counts.clone().scatter_add_(2, below, mask[:, :, 1:].float())
    x = penalize_rows(
        logits.view(b, n, v),
        node_counts,
        st.prompt.index_select(0, rows)[:, None],
        st.bias.index_select(0, rows)[:, None],
        rep[:, None],
        freq[:, None],
        pres[:, None],
    )
    early = tracked[:, None] & (out_len[:, None] + depth < mins[:, None])
    x = ban_rows(x, early, st.stops.index_select(0, rows)[:, None])
    return torch.where(tracked[:, None, None], x, logits.view(b, n, v).float()).view(b * n, v)


def decode_inputs(g, bb: int, keys: list[Hashable], tokens: list[int], rows: list[PenaltyRow | None] | None) -> tuple:
    """A plain decode graph's penalty_inputs, padded to bb (none where every row's logits are the raw ones); tokens:
    the rows' tokens (-1 - i: a future token, decode_graphs.decode)."""
    if rows is None or all(x is None for x in rows):
        return ()
    return penalty_inputs(g, keys, g._table.rows_of(keys), [t < 0 for t in tokens], rows, bb)


def decode_penalized(
    g,
    bufs: dict,
    rows: torch.Tensor,  # [B] int64 each row's table row
    chained: torch.Tensor,  # [B] bool: the row's token is the previous decode step's (a future token)
    ids: torch.Tensor,  # [B] int64 each row's token (its root)
    logits: torch.Tensor,  # [B, V]
) -> torch.Tensor:  # [B, V] float32
    """Inside a plain decode graph (decode_graphs.decode): penalized_logits of one-node trees, each chained row's
    previous token its root."""
    one, root = torch.ones_like(ids), ids[:, None]
    return penalized_logits(penalty_state(g), bufs["penalty"], rows, chained, one, root, root, None, 0 * root, logits)
