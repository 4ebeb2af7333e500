"""Lossless verification of token trees. Pure functions: they never touch KV caches or requests.

Terminology:
- accepted tokens: draft tokens on the root-to-leaf path the target agrees with;
- rejected tokens: every other draft node (their K/V is discarded by the engine);
- bonus token: one token the target itself supplies after the accepted path (its argmax, or a
  sample from the target's residual distribution). It becomes the next tree's root.

So every verify step emits accepted + 1 tokens; tau (acceptance length) = mean of that.

Greedy: walk from the root; at each node, the child whose token equals the target's argmax at
that node is accepted (SGLang's verify_tree_greedy, sibling lists in index order).

Sampling (SpecInfer multi-step speculative sampling, in its general form): at a node with
target distribution p (after temperature/top-k/top-p) and children x_1..x_m proposed from q_1..q_m
(each drawn independently given the past; a deterministic top-k proposal is the point mass
q_i = onehot(x_i)):
    for i in 1..m: accept x_i with probability min(1, p(x_i)/q_i(x_i)); on accept, descend;
                   on reject, p <- normalize(max(0, p - q_i))
    if all rejected: bonus ~ p (the residual)
Each trial is a standard rejection-sampling step whose output law is exactly the current p, so
the emitted token is distributed as the target's p; by induction over depth, the whole output is.
For a chain drafted by sampling from q this is Leviathan et al.'s speculative sampling.

Seeded sampling (coupled_path): when a request has a seed, the target's token at each node is its
seeded sample (sampling.seeded_sample: Gumbel-max with noise hashed from (seed, position)), and the
walk accepts the child holding that token, as greedy verification does with the argmax. The output
is then plain seeded decoding's, token for token, whatever was drafted. For point-mass proposals
(lookup drafters, top-k trees) the chance that some child is accepted is the same as above (the sum
of p over the children); for sampled chains it is lower (sum of p*q instead of sum of min(p, q)).

One form of each, on the device (greedy_path and, for a batch, greedy_paths; sampling_path; coupled_path):
tensors in, an AcceptedPath of tensors out, no host read (no .item(), .tolist(), boolean-mask gather or
nonzero); `to_host` then copies every request's path in one read, the step's only one. The rules' plainest
form, host loops over one tree, are the tests' oracles (tests/oracles.py): greedy_path / coupled_path give
their results on the same device; sampling_path draws its random numbers up front (the oracle draws per
trial): the same law, other samples for a seed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .device import to_device
from .sampling import TokenLogprob, draw, gumbel_noise, int64
from .tree import TokenTree


@dataclass
class VerifyResult:
    accepted_nodes: list[int]  # node indices on the accepted path, root (0) first
    tokens: list[int]  # accepted draft tokens followed by the bonus token
    # the tree was a faulty drafter's: a token outside the vocabulary or non-finite draft logits (AcceptedPath)
    draft_invalid: bool = False
    tree_argmax: list[int] | None = None  # the target's argmax at every node, when asked (AcceptedPath)
    logprobs: list[TokenLogprob] | None = None  # each accepted token's, when the request asked (AcceptedPath)

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


@dataclass
class AcceptedPath:
    """A verification's result on the device, before the step's one copy to the host (to_host)."""

    nodes: torch.Tensor  # [N] int64: node indices on the accepted path, root (0) first, then -1
    tokens: torch.Tensor  # [N] int64: the accepted draft tokens, then the bonus token, then -1
    # [] bool, optional: the tree was a faulty drafter's (a token outside the target's vocabulary, or
    # drafted from non-finite logits: TokenTree.finite). Such a token is never accepted and any valid
    # tree is verified losslessly, so the path stays right; the flag travels in the same copy, so the
    # caller learns it without a read of its own.
    draft_invalid: torch.Tensor | None = None
    # [N] int64, optional: the target's argmax (raw logits) at every node of the tree, for a drafter that
    # learns from it (TargetCapture.tree_argmax), copied with the path rather than read after it
    tree_argmax: torch.Tensor | None = None
    # optional, for a request that asked for logprobs: at each path row (as `nodes`), the log-probability
    # of `tokens` under the target's raw logits, and the k likeliest (logprobs, token ids); path_logprobs
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # [N] float, [N, k] float, [N, k] int64


def path_logprobs(path: AcceptedPath, logits: torch.Tensor, k: int) -> None:
    """Sets path.logprobs from the tree's raw logits [N, V] (rows by node index), on their device: the
    rows of the path's nodes (padding rows read node 0 and are never copied out)."""
    rows = torch.log_softmax(logits[path.nodes.clamp(min=0)].float(), dim=-1)  # [N, V]
    chosen = rows.gather(1, path.tokens.clamp(min=0)[:, None])[:, 0]
    vals, ids = rows.topk(k, dim=-1) if k else (rows[:, :0], path.tokens[:, None][:, :0])
    path.logprobs = (chosen, vals, ids)


def tokens_to_host(tokens: torch.Tensor) -> list[int]:
    """A plain greedy decode step's one device-to-host copy: its tokens [B] (ModelRunner.decode)."""
    return tokens.tolist()


def to_host(paths: list[AcceptedPath]) -> list[VerifyResult]:
    """Every request's path in one device-to-host copy (the only host read of a verify step). Layout of the
    int64 copy: per path its nodes, tokens, [tree_argmax], [logprob ids]; then every path's draft_invalid
    flag, stacked (two ops for the batch, not two per drafted path)."""
    if not paths:
        return []
    parts, floats = [], []
    flags = [p.draft_invalid for p in paths if p.draft_invalid is not None]  # each [] bool
    for p in paths:
        parts += [p.nodes, p.tokens]
        parts += [] if p.tree_argmax is None else [p.tree_argmax.long()]
        if p.logprobs is not None:
            parts.append(p.logprobs[2].reshape(-1))
            floats += [p.logprobs[0], p.logprobs[1].reshape(-1)]
    if flags:
        parts.append(torch.stack([f if f.dim() == 0 else f.reshape(()) for f in flags]).long())
    if floats:  # two dtypes: both copies queued, one wait
        flat, flat_f = (t.tolist() for t in _download([torch.cat(parts), torch.cat(floats)]))
    else:
        flat, flat_f = torch.cat(parts).tolist(), []
    out, at, at_f = [], 0, 0
    invalid_flags = iter(flat[len(flat) - len(flags) :])
    for p in paths:
        n = p.nodes.numel()
        nodes, tokens = flat[at : at + n], flat[at + n : at + 2 * n]
        k = n - nodes.count(-1)
        at += 2 * n
        invalid = p.draft_invalid is not None and bool(next(invalid_flags))
        argmax = None
        if p.tree_argmax is not None:
            argmax, at = flat[at : at + p.tree_argmax.numel()], at + p.tree_argmax.numel()
        lps = None
        if p.logprobs is not None:
            width = p.logprobs[1].shape[1]
            ids, at = flat[at : at + n * width], at + n * width
            chosen, vals = flat_f[at_f : at_f + n], flat_f[at_f + n : at_f + n + n * width]
            at_f += n + n * width
            lps = [
                TokenLogprob(
                    tokens[i],
                    chosen[i],
                    tuple(zip(ids[i * width : (i + 1) * width], vals[i * width : (i + 1) * width])),
                )
                for i in range(k)
            ]
        out.append(VerifyResult(nodes[:k], tokens[:k], invalid, argmax, lps))
    return out


def _download(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors (on one device) on the host, with one wait: from a GPU, queued copies into pinned
    memory, then one synchronize (a plain .cpu() would wait once per tensor)."""
    if tensors[0].device.type != "cuda" or not torch.cuda.is_available():  # (fake CUDA in tests: .cpu() reads)
        return [t.cpu() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


# --- the walk, on the device ---------------------------------------------------------------------
# Verification is a walk from the root: at each node, its children are tried in sibling-list order
# and the first one that passes is accepted. Whether a child passes when tried never depends on
# later siblings, so it is computed for every node at once (`ok`); then each node's first passing
# child (`choice`), and the path is `choice` followed from the root. Fixed shapes throughout: no
# value is read back to the host, and the loops run a count known on the host (log N, the depth).


def tree_lists(tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner [N]: the node whose child list holds each node, -1 for none (the root, unlinked nodes); rank [N]:
    its place in that list, 0 first), for a TokenTree: its lists hold the linked children of each node in
    index order (tree_from_parents builds them so), so owner = parent for a node in some list and rank = its
    linked elder siblings. (The general list ranking, for any lists: tests/oracles.py sibling_lists.)"""
    n = tree.num_nodes
    nxt, sib = tree.retrieve_next_token, tree.retrieve_next_sibling
    listed = torch.zeros(n + 1, dtype=torch.bool, device=nxt.device)
    # (index_fill_: `listed[idx] = True` copies the Python scalar up and waits on a GPU)
    listed.index_fill_(0, torch.where(nxt >= 0, nxt, n), True).index_fill_(0, torch.where(sib >= 0, sib, n), True)
    listed = listed[:n]
    owner = torch.where(listed, tree.parents, -1)
    ar = torch.arange(n, device=nxt.device)
    elder = (owner[None, :] == owner[:, None]) & (ar[None, :] < ar[:, None]) & listed[None, :]  # [node, elder]
    return owner, elder.sum(1)


def first_passing_child(owner: torch.Tensor, rank: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """[..., N] each node's first child (in list order) with ok set, -1 if none."""
    n = owner.shape[-1]
    ar = torch.arange(n, device=owner.device)
    none = n * n
    key = torch.where(ok & (owner >= 0), rank * n + ar, none)
    best = key.new_full(owner.shape[:-1] + (n + 1,), none)
    best = best.scatter_reduce(-1, torch.where(owner >= 0, owner, n), key, "amin")[..., :n]
    return torch.where(best < none, best % n, -1)


def path_in_tree(tree: TokenTree, choice: torch.Tensor) -> torch.Tensor:
    """The path from the root following `choice`, for a TokenTree in a fixed number of ops (no loop over the
    depth): a node is on the path when it and each of its ancestors below the root are their parent's choice,
    and the path lists those nodes by depth. [N] choice -> [N] nodes, -1 after the path."""
    n = tree.num_nodes
    ar = torch.arange(n, device=choice.device)
    chosen = (choice[tree.parents.clamp(min=0)] == ar) | (ar == 0)
    on = ~(tree.tree_mask & ~chosen[None, :]).any(1)
    depth = tree.positions - tree.positions[0]
    return choice.new_full((n + 1,), -1).scatter_(0, torch.where(on, depth, n), ar)[:n]


def _accepted(tree: TokenTree, nodes: torch.Tensor, bonus: torch.Tensor) -> AcceptedPath:
    """nodes [N]: the path (-1 after it); bonus [N]: the bonus token if the path ends at that node."""
    nxt = torch.cat([nodes[1:], nodes.new_full((1,), -1)])
    tokens = torch.where(nxt >= 0, tree.draft_tokens[nxt.clamp(min=0)], bonus[nodes.clamp(min=0)])
    return AcceptedPath(nodes, torch.where(nodes >= 0, tokens, -1))


def _target_path(tree: TokenTree, target: torch.Tensor) -> AcceptedPath:
    """The path where a child passes if it holds the target's token at its parent (target [N]: the
    token the target picks after each node); the bonus is the target's token at the last node."""
    if tree.num_nodes == 1:  # the root alone: its token is the bonus
        return AcceptedPath(torch.zeros_like(target), target)
    owner, rank = tree_lists(tree)
    ok = tree.draft_tokens == target[owner.clamp(min=0)]
    return _accepted(tree, path_in_tree(tree, first_passing_child(owner, rank, ok)), target)


def greedy_path(tree: TokenTree, target_argmax: torch.Tensor) -> AcceptedPath:
    """One request on the device. target_argmax [N]: the target's argmax at each node."""
    return _target_path(tree, target_argmax.reshape(-1).long())


def greedy_paths(
    trees: list[TokenTree],
    target_argmax: torch.Tensor,  # [R] the target's argmax at every row of the trees (and maybe others)
    vocab: int | None = None,
    starts: list[int] | None = None,
) -> list[AcceptedPath]:
    """greedy_path for each of a batch's trees, in a fixed number of device ops for the whole batch: the
    trees are packed [B, W] (W their largest size, padding past each tree's nodes), and every request's
    path and bonus come from ops over that. Tree b's rows are target_argmax[starts[b] : starts[b] + n_b]
    (default: the trees' rows one after another). vocab: when given, each drafted tree's path (more than
    the root) carries draft_invalid: a token outside [0, vocab) or non-finite draft logits
    (TokenTree.finite). Each path is a view of the batch's rows, as long as its tree (as greedy_path's)."""
    sizes = [t.num_nodes for t in trees]
    if starts is None:
        starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    b, w = len(trees), max(sizes)
    dev = target_argmax.device
    if w == 1:  # root-only trees (plain decode steps): each path is the root, its token the target's there
        if starts == list(range(starts[0], starts[0] + b)):
            tokens = target_argmax[starts[0] : starts[0] + b]
        else:
            tokens = target_argmax[to_device(torch.tensor(starts), dev)]
        tokens = tokens.view(b, 1)
        return [AcceptedPath(z, x) for z, x in zip(torch.zeros_like(tokens).unbind(0), tokens.unbind(0))]
    fields_ = [(t.draft_tokens, t.parents, t.positions, t.retrieve_next_token, t.retrieve_next_sibling) for t in trees]
    if sizes == [w] * b and starts == list(range(starts[0], starts[0] + b * w, w)):  # (one search's trees)
        # no padding: every tree's fields one after another are the packed rows, as are the argmax rows
        tokens, parents, positions, nxt, sib = torch.cat([f for fs in fields_ for f in fs]).view(b, 5, w).unbind(1)
        target = target_argmax[starts[0] : starts[0] + b * w].view(b, w)
    else:
        # one flat int64 tensor (TokenTree's fields are int64): every tree's fields, then the argmax rows,
        # then the padding values -1 and 0; one gather packs it
        flat = torch.cat([f for fs in fields_ for f in fs] + [target_argmax, torch.arange(-1, 1, device=dev)])
        idx = _pack_index(sizes, starts, w, flat.numel() - 2)
        tokens, parents, positions, nxt, sib, target = flat[to_device(idx, dev)].unbind(1)  # each [B, W]
    nodes, out = greedy_rows(tokens, parents, positions, nxt, sib, target)
    bad = ((tokens < 0) | (tokens >= vocab)).any(1) if vocab is not None and w > 1 else None
    return paths_from_rows(trees, nodes, out, bad)


def greedy_rows(
    tokens: torch.Tensor,  # [B, W] packed trees (padding past each tree: token 0, parents / lists -1)
    parents: torch.Tensor,
    positions: torch.Tensor,
    nxt: torch.Tensor,
    sib: torch.Tensor,
    target: torch.Tensor,  # [B, W] the target's argmax at each node
) -> tuple[torch.Tensor, torch.Tensor]:
    """(nodes [B, W]: each tree's greedy path, root first, -1 after it; tokens [B, W]: its accepted drafts
    then the bonus, -1 after it): device ops of fixed shapes (a verify graph runs them)."""
    b = tokens.shape[0]
    nodes = _greedy_nodes(tokens, parents, positions, nxt, sib, target)
    after = torch.cat([nodes[:, 1:], nodes.new_full((b, 1), -1)], 1)  # [B, W] the next node on the path
    out = torch.where(after >= 0, tokens.gather(1, after.clamp(min=0)), target.gather(1, nodes.clamp(min=0)))
    return nodes, torch.where(nodes >= 0, out, -1)


def paths_from_rows(
    trees: list[TokenTree], nodes: torch.Tensor, out: torch.Tensor, bad: torch.Tensor | None
) -> list[AcceptedPath]:
    """Each tree's AcceptedPath from greedy_rows' rows (row b: trees[b]; as wide as the largest tree or
    wider): views, as long as its tree. bad [B] (a token outside the vocabulary) or None: not checked;
    when given, each drafted tree's path carries draft_invalid (bad, or its drafter's non-finite logits)."""
    sizes = [t.num_nodes for t in trees]
    invalid = [None] * len(trees)
    if bad is not None:
        finite = [t.finite for t in trees]  # each [] bool or None
        if all(f is finite[0] for f in finite) and finite[0] is not None:  # one search's trees share theirs
            bad = bad >= finite[0]  # (bools: bad | ~finite in one op)
        elif any(f is not None for f in finite):
            yes = torch.ones((), dtype=torch.bool, device=bad.device)
            bad = bad | ~torch.stack([yes if f is None else f for f in finite])
        invalid = [None if n == 1 else v for n, v in zip(sizes, bad.unbind(0))]
    w = max(sizes)
    if nodes.shape[1] > w:  # (rows wider than every tree: two views, not two per tree)
        nodes, out = nodes[:, :w], out[:, :w]
    paths = []
    for n, row_nodes, row_tokens, inv in zip(sizes, nodes.unbind(0), out.unbind(0), invalid):
        if n < w:
            row_nodes, row_tokens = row_nodes[:n], row_tokens[:n]
        paths.append(AcceptedPath(row_nodes, row_tokens, inv))
    return paths


@dataclass
class GreedyRows:
    """A verify forward's greedy results, computed inside its graph (GraphRunner.run with trees): the
    logits [T, V] and their argmax [T] at the trees' rows, and per request (row b: request b, W >= its
    tree's size) greedy_rows' nodes and tokens [B, W] and whether its tree holds a token outside the
    vocabulary [B]."""

    logits: torch.Tensor
    argmax: torch.Tensor
    nodes: torch.Tensor
    tokens: torch.Tensor
    bad: torch.Tensor

    def paths(self, trees: list[TokenTree], which: list[int]) -> list[AcceptedPath]:
        """greedy_paths(trees, argmax, vocab) for the requests `which` (trees[k] is request which[k]'s)."""
        nodes, out, bad = self.nodes, self.tokens, self.bad
        if which != list(range(len(which))):
            at = to_device(torch.tensor(which, dtype=torch.long), nodes.device)
            nodes, out, bad = nodes[at], out[at], bad[at]
        return paths_from_rows(trees, nodes, out, bad if max(t.num_nodes for t in trees) > 1 else None)


def greedy_results(
    trees: list[TokenTree],
    target: list[int],  # the target's argmax at every row of the trees (and maybe others), host values
    starts: list[int],  # tree b's rows are target[starts[b] : starts[b] + n_b]
    vocab: int,
) -> list[VerifyResult]:
    """greedy_paths' results on the host, for trees on the CPU (a CPU step: ~30 tensor ops cost ~0.4 ms, the
    walk over a few nodes a few microseconds): from the root, each node's first child in list order
    (retrieve_next_token, then retrieve_next_sibling) holding the target's token at that node is accepted;
    the bonus is the target's token at the path's last node. draft_invalid as greedy_paths gives it (a drafted
    tree only): a token outside [0, vocab) or non-finite draft logits. One host read for the batch's lists."""
    sizes = [t.num_nodes for t in trees]
    drafted = [t for t, n in zip(trees, sizes) if n > 1]
    fields_ = [f for t in drafted for f in (t.draft_tokens, t.retrieve_next_token, t.retrieve_next_sibling)]
    flat = torch.cat(fields_).tolist() if fields_ else []
    out, at = [], 0
    for t, n, s in zip(trees, sizes, starts):
        if n == 1:
            out.append(VerifyResult([0], [target[s]]))
            continue
        tokens, nxt, sib = flat[at : at + n], flat[at + n : at + 2 * n], flat[at + 2 * n : at + 3 * n]
        at += 3 * n
        nodes, node = [0], 0
        child, tried = nxt[0], 0
        while child >= 0:
            tried += 1
            if tried > n:  # (a list with a cycle: not a tree greedy_paths takes either)
                raise ValueError("tree child lists do not end")
            if tokens[child] == target[s + node]:
                nodes.append(child)
                node, child = child, nxt[child]
            else:
                child = sib[child]
        accepted = [tokens[x] for x in nodes[1:]] + [target[s + node]]
        invalid = any(not 0 <= x < vocab for x in tokens) or (t.finite is not None and not bool(t.finite))
        out.append(VerifyResult(nodes, accepted, invalid))
    return out


def _pack_index(sizes: list[int], starts: list[int], w: int, pad: int) -> torch.Tensor:
    """[B, 6, W] int64 on the host: where greedy_paths' packed rows read its flat tensor. Rows 0-4: tree
    b's fields (5 * n_b values from its offset, field after field); row 5: its argmax rows (the argmax
    follows every tree's fields); past n_b: `pad` (-1) for every row but the tokens', which read pad + 1 (0)."""
    n = torch.tensor(sizes, dtype=torch.long)  # [B]
    field_at = (5 * n).cumsum(0) - 5 * n  # [B] where tree b's fields start
    row_at = torch.tensor(starts, dtype=torch.long) + 5 * n.sum()  # [B] where tree b's argmax rows start
    at = torch.cat([field_at[:, None] + torch.arange(5) * n[:, None], row_at[:, None]], 1)  # [B, 6]
    ar = torch.arange(w)
    fill = torch.tensor([pad + 1] + [pad] * 5, dtype=torch.long)
    return torch.where(ar < n[:, None, None], at[:, :, None] + ar, fill[:, None])


def _greedy_nodes(
    tokens: torch.Tensor,  # [B, W] node tokens (padding: 0)
    parents: torch.Tensor,  # [B, W] (-1: the root, padding)
    positions: torch.Tensor,  # [B, W] seq_len + depth
    nxt: torch.Tensor,  # [B, W] retrieve_next_token (padding: -1)
    sib: torch.Tensor,  # [B, W] retrieve_next_sibling (padding: -1)
    target: torch.Tensor,  # [B, W] the target's argmax at each node
) -> torch.Tensor:
    """[B, W] each tree's greedy path (node indices by depth, root first, -1 after it), as _target_path
    gives it tree by tree. Rules: a node is tried when it is in some child list (linked), under its
    parent (tree_lists); it passes when its token is the target's at its parent; each node's choice is
    its first passing child in list order, which is index order (tree_lists); a node is on the path when
    it and each of its ancestors is its parent's choice (path_in_tree: there by the ancestor mask, here
    by following parents with pointer doubling, log W rounds)."""
    b, w = tokens.shape
    ar = torch.arange(w, device=tokens.device).expand(b, w)
    listed = torch.zeros(b, w + 1, dtype=torch.bool, device=tokens.device)
    listed.scatter_(1, torch.where(nxt >= 0, nxt, w), True).scatter_(1, torch.where(sib >= 0, sib, w), True)
    listed = listed[:, :w]
    ok = listed & (parents >= 0) & (tokens == target.gather(1, parents.clamp(min=0)))
    key = torch.where(ok, ar, w)
    best = key.new_full((b, w + 1), w).scatter_reduce(1, torch.where(ok, parents, w), key, "amin")[:, :w]
    choice = torch.where(best < w, best, -1)  # [B, W] each node's first passing child, -1 if none
    on = (choice.gather(1, parents.clamp(min=0)) == ar) | (ar == 0)  # [B, W] its parent's choice (the root: on)
    up = torch.where(parents >= 0, parents, ar)
    for _ in range(max(w - 1, 0).bit_length()):  # on covers distances 0 .. 2^k - 1 up the parents
        on = on & on.gather(1, up)
        up = up.gather(1, up)
    depth = positions - positions[:, :1]
    return ar.new_full((b, w + 1), -1).scatter_(1, torch.where(on, depth, w), ar)[:, :w]


def coupled_path(
    tree: TokenTree, target_probs: torch.Tensor, seed: int, seq_len: int, max_depth: int | None = None
) -> AcceptedPath:
    """One seeded request on the device (see the module docstring). target_probs [N, V]: the target's
    processed distribution at each node; seq_len: the root's position (tree.positions[0], known on
    the host); max_depth: a bound on the tree's depth (default N - 1), so the noise is drawn for that
    many positions only."""
    n, vocab = target_probs.shape
    depth = tree.positions - tree.positions[0]
    d = n - 1 if max_depth is None else min(max_depth, n - 1)
    at = torch.tensor([[int64(seed), seq_len + 1 + k] for k in range(d + 1)], dtype=torch.long)
    at = to_device(at, target_probs.device)
    noise = gumbel_noise(at[:, 0], at[:, 1], vocab)  # [D+1, V]: the noise of the token after a node at each depth
    return _target_path(tree, (target_probs.log() + noise[depth.clamp(max=d)]).argmax(-1))


# --- speculative sampling on the device ------------------------------------------------------------


def sampling_path(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None, max_children: int | None = None
) -> AcceptedPath:
    """One request on the device: multi-step speculative sampling (module docstring) with every random
    number drawn up front, on target_probs' device: u [N] (node c's trial uses u[c]) and one exponential
    race over the vocab for the bonus. So the samples for a seed differ from the oracle's (which draws per
    trial), the law does not (tests/sglang_ext/test_device_step.py: chi2).
    target_probs [N, V]: the target's processed distribution at each node; max_children: the most
    children a node has, when known (a chain: 1; default N - 1): the rounds of sampled proposals.
    A root-only tree (a plain decode step) draws its bonus alone: torch.multinomial's draw of p.
    A drafted token outside the vocabulary is never tried (as if unlinked)."""
    n, vocab = target_probs.shape
    if n == 1:  # the root alone: the bonus is drawn from p (multinomial's draw, no trial's numbers)
        bonus = draw(target_probs.float(), generator)
        return AcceptedPath(torch.zeros_like(bonus), bonus)
    p = target_probs.double()
    owner, rank = tree_lists(tree)
    x = tree.draft_tokens
    # a token outside the vocabulary (a faulty drafter) is left out of its parent's list: never tried,
    # so it neither passes nor changes the residual (greedy and coupled paths never match it either)
    owner = torch.where((x >= 0) & (x < vocab), owner, -1)
    x = x.clamp(0, vocab - 1)
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=p.device)
    if tree.draft_probs is None:
        ok, residual = point_mass_trials(p, x, owner, rank, u)
    else:
        rounds = n - 1 if max_children is None else max_children
        ok, residual = sampled_trials(p, tree.draft_probs.double(), x, owner, rank, u, rounds)
    nodes = path_in_tree(tree, first_passing_child(owner, rank, ok))
    last = nodes.gather(0, ((nodes >= 0).sum() - 1).view(1))  # [1] the path's last node
    bonus = draw(residual(last).float(), generator)
    return _accepted(tree, nodes, bonus.expand(n))


def point_mass_trials(
    p: torch.Tensor,  # [N, V] float64 target distribution at each node
    x: torch.Tensor,  # [N] node tokens
    owner: torch.Tensor,  # [N] (tree_lists)
    rank: torch.Tensor,  # [N]
    u: torch.Tensor,  # [N] float64 uniforms
):
    """Deterministic proposals (point masses). Rejecting x zeroes p(x) and renormalizes, so when child
    c is tried, its parent's residual is p(x_c) / (1 - S_c), S_c the mass of the distinct tokens of the
    siblings tried before it (0 if one of them held x_c). Returns (ok [N], residual: last [1] -> [V]
    the distribution of the bonus when the path ends at `last`, every child of it rejected)."""
    n, vocab = p.shape
    px = p[owner.clamp(min=0), x]  # [N] each node's token under its parent's distribution
    earlier = (owner[None, :] == owner[:, None]) & (owner[:, None] >= 0) & (rank[None, :] < rank[:, None])  # [c, s]
    dup = (earlier & (x[None, :] == x[:, None])).any(1)  # an earlier sibling held the same token
    mass = torch.where(earlier & ~dup[None, :], px[None, :], 0.0).sum(1)
    left = 1.0 - mass
    # NOTE: left <= 0 (the earlier siblings held all of p, up to rounding): fall back to p, as the oracle does
    before = torch.where(dup, 0.0, torch.where(left > 0, px / left.clamp(min=1e-300), px))
    ok = u < before

    def residual(last: torch.Tensor) -> torch.Tensor:
        row = p[last][0]
        rejected = torch.where(owner == last, x, vocab)  # the children's tokens; the rest -> column V
        keep = row.new_ones(vocab + 1).scatter_(0, rejected, 0.0)[:vocab]
        res = row * keep
        return torch.where(res.sum() > 0, res, row)

    return ok, residual


def sampled_trials(
    p: torch.Tensor,  # [N, V] float64 target distribution at each node
    q: torch.Tensor,  # [N, V] float64 proposal each node's token was drawn from (row 0 unused)
    x: torch.Tensor,  # [N] node tokens
    owner: torch.Tensor,  # [N] (tree_lists)
    rank: torch.Tensor,  # [N]
    u: torch.Tensor,  # [N] float64 uniforms
    rounds: int,  # >= the most children any node has
):
    """Sampled proposals: rejecting child c turns its parent's residual r into normalize(max(0, r - q_c)).
    Round k applies every node's k-th child to that node's residual row at once. Returns (ok [N],
    residual: last [1] -> [V], the residual after all of last's children)."""
    n = p.shape[0]
    ar = torch.arange(n, device=p.device)
    res = p.clone()  # row j: node j's residual after the children applied so far
    before = p.new_zeros(n)  # the parent's residual at each node's token when it is tried
    for k in range(rounds):
        at = (rank == k) & (owner >= 0)
        kid = owner.new_full((n + 1,), -1).scatter_(0, torch.where(at, owner, n), ar)[:n]  # node j's k-th child
        before = torch.where(at, res[owner.clamp(min=0), x], before)
        new = (res - q[kid.clamp(min=0)]).clamp_(min=0.0)
        total = new.sum(-1, keepdim=True)
        new = torch.where(total > 0, new / total, p)  # p covered by q exactly: fall back to p
        res = torch.where((kid >= 0)[:, None], new, res)
    qx = q[ar, x]
    ok = (qx > 0) & (u * qx < before)
    return ok, lambda last: res[last][0]
