"""A plain decode step's graph on the target's GraphRunner (serving/decode_step.py): one row per request, its logits
and its token inside the graph, so that the step's only inputs are one upload (tokens, positions, slots, and what
the slot table's rows lack; with rules, their per-request values) and its only output the tokens (with their
logprobs where rows ask, below).

Future tokens (SGLang's future token map): the graph also leaves its tokens in a buffer of the runner
(GraphRunner._future), row i's at [i], and a token given as -1 - i is read from there inside the graph: the token
row i of the runner's previous decode step produced, which the host has not read (the overlapped loop issues step
N+1 before it reads step N: serving/decode_step.py).

A row's token is the argmax of its logits, or, for a sampled request, its coupled sample (sampling.coupled_tokens,
the ops of the chained spec verify, models/spec_graphs.py: argmax of log p + the noise of (seed, the row's position
+ 1), p under its temperature, top_k and top_p), which is the token the ordinary step's verify.coupled_path gives a
root-only tree, so a seeded request's tokens are plain seeded decoding's. With penalties, each row's logits are its
request's under its penalties and min_tokens first (models/penalty_graphs.py: a row reading a future token adds it
to its request's state first). Graphs of their own per kind: penalized or not, sampled (filtering or not) or not;
the parameters' values are inputs, so a batch of the same kind replays the graph it replayed before.

A step whose requests ask for logprobs (`top`: K, their widest top_logprobs bucketed as the chained spec verify's:
serving/spec_step.py's top_bucket; a graph per K) gives, beside each row's token, its logprob and the K likeliest
tokens' logprobs and ids, from the raw logits (before penalties, as the ordinary step's verify.path_logprobs) with
the chained spec verify's ops for a root-only row (models/spec_graphs.py: graph_path_logprobs, its path the one
node): one [B, 2 + 2K] int64 output, the floats as their fp32 bits (spec_graphs.path_logprobs_of reads them from
column 1), still the step's one copy. Each request takes its own k of the K (the others ignore theirs).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..sampling import coupled_tokens, greedy_tokens, sampling_buffers, sampling_rows
from .graph_runner import GraphRunner, fill_flat
from .kv_pool import KVPool
from .penalty_graphs import decode_inputs, decode_penalized, penalty_buffers
from .spec_graphs import graph_path_logprobs


def decode(
    g: GraphRunner,
    keys: list[Hashable],  # per request its key (GraphRunner.run's)
    tokens: list[int],  # per request the token its one row reads (the root), or -1 - i: a future token
    out_slots: torch.Tensor,  # [B] int64 host ids: where each row's K/V is written
    prefixes: list[torch.Tensor],  # per request [P_b] committed slots (the row's position is P_b)
    kv: KVPool,
    penalties: list | None = None,  # per request its logits rules (penalty_graphs.PenaltyRow) or None: raw
    sampling: list[tuple[float, int, float, int]] | None = None,  # per request (temperature, top_k, top_p, seed)
    top: int | None = None,  # K: each row's logprobs and its K likeliest come out with its token (None: no logprobs)
) -> torch.Tensor:  # [B] int64 on the device: the token after each row; with top [B, 2 + 2K] (module docstring)
    """A plain decode step (module docstring) on g's stream: one fill and one replay. sampling (None: every request
    greedy): each request's parameters, temperature 0 for a greedy one, seed an int64 (sampling.int64). The result is
    a view of the graph's output: queue its copy to the host before the next run."""
    n = len(keys)
    key = g.bucket_of([1] * n, [p.numel() for p in prefixes])
    if key is None:
        raise ValueError(f"{n} decode rows after prefixes {[p.numel() for p in prefixes]} fit no graph bucket")
    g._use_pool(kv)
    g.runs += 1
    front = [*tokens, *(p.numel() for p in prefixes)]
    longs, done = g._keyed_inputs((*key, "decode"), keys, [1] * n, prefixes, front, [out_slots])
    pen = decode_inputs(g, key[0], keys, tokens, penalties)
    samp, params = sampling_rows(sampling, key[0], g.model.cfg.vocab_size)
    key = (*key, "decode", bool(pen), samp, top)

    def fill(bufs: dict) -> None:
        ins = (longs, *pen, *params)
        for buf, x in zip((bufs["longs"], *bufs.get("penalty", ()), *bufs.get("sampling", ())), ins):
            fill_flat(buf, x)

    out = g.cache.run(key, lambda: _buffers(g, key, params), fill, lambda bufs: _decode_fn(g, key, bufs, kv))
    done()
    return out[1][:n]


def _buffers(g: GraphRunner, key: tuple, params: tuple) -> dict:
    """The bucket's static inputs (a keyed bucket's, GraphRunner._buffers), and its rules' inputs."""
    bufs = g._buffers(key[:4])
    if key[4]:  # (penalty_graphs.penalty_inputs')
        bufs["penalty"] = penalty_buffers(key[0], g.model.device)
    if key[5] is not None:  # (sampling.sampling_rows')
        bufs["sampling"] = sampling_buffers(params, g.model.device)
    return bufs


def _decode_fn(g: GraphRunner, key: tuple, bufs: dict, kv: KVPool):
    """The captured function: the table's rows made whole and read, each row's future token, the static plan, the
    model's forward, the logits (penalized where the key says) and each row's token -> (output, tokens [B]; with
    the key's K: [B, 2 + 2K], each row's token then its logprobs)."""
    b, _, _, _, pen, samp, top = key
    ids, pos, slots, prefix, prefix_len = g._table.read(bufs["longs"], key[:3])
    chained = ids < 0  # future tokens: -1 - i reads the previous decode's row i
    ids = torch.where(chained, g._future[(-1 - ids).clamp_(min=0)], ids)
    out = g.static_forward(ids, pos, slots, prefix, prefix_len, bufs["mask"], kv)
    raw = logits = g.model.logits(out.hidden, fp32=False)
    if pen:  # (each row's root, the previous decode's token where chained, joins its state)
        logits = decode_penalized(g, bufs, bufs["longs"][3 * b : 4 * b], chained, ids, logits)
    if samp is None:
        tokens = greedy_tokens(logits)
    else:  # (a sampled row's token at position pos + 1: the noise of (seed, pos + 1), as verify.coupled_path's)
        flag, top_k, seed, temp, top_p = bufs["sampling"]  # [B] each
        tokens = coupled_tokens(logits, flag > 0, temp, top_k, top_p, seed, pos + 1, samp)
    # (real rows only: a capture's padding batch, slot 0 everywhere, leaves them)
    g._future[:b].copy_(torch.where(slots > 0, tokens, g._future[:b]))
    if top is None:
        return out, tokens
    # (a root-only path: its one node's raw logits row, its token the row's; as the chained verify takes them)
    node, path = torch.zeros_like(tokens)[:, None], tokens[:, None]
    return out, torch.cat([path, *graph_path_logprobs(raw.view(b, 1, -1), node, path, top)], 1)
