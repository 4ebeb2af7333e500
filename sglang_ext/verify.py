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

Seeded sampling (coupled_verify): when a request has a seed, the target's token at each node is its
seeded sample (sampling.seeded_sample: Gumbel-max with noise keyed by (seed, position)), and the
walk accepts the child holding that token, as greedy verification does with the argmax. The output
is then plain seeded decoding's, token for token, whatever was drafted. For point-mass proposals
(lookup drafters, top-k trees) the chance that some child is accepted is the same as above (the sum
of p over the children); for sampled chains it is lower (sum of p*q instead of sum of min(p, q)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import seeded_sample
from .tree import TokenTree


@dataclass
class VerifyResult:
    accepted_nodes: list[int]  # node indices on the accepted path, root (0) first
    tokens: list[int]  # accepted draft tokens followed by the bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


def verify_tree_greedy(
    candidates: torch.Tensor,  # [bs, N] node tokens (root first)
    retrieve_index: torch.Tensor,  # [bs, N]
    retrieve_next_token: torch.Tensor,  # [bs, N]
    retrieve_next_sibling: torch.Tensor,  # [bs, N]
    target_predict: torch.Tensor,  # [bs, N] target argmax at each node
    num_speculative_tokens: int,  # max accepted nodes incl. root (SGLang: steps + 1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's greedy tree verification, same outputs.

    Returns predicts [bs*N] (target token written at accepted nodes and the last one, else 0),
    accept_index [bs, num_speculative_tokens] (flat node ids, -1 padded), accept_token_num [bs].
    """
    bs, n = candidates.shape
    cand, ridx = candidates.tolist(), retrieve_index.tolist()
    nxt, sib, tgt = retrieve_next_token.tolist(), retrieve_next_sibling.tolist(), target_predict.reshape(-1).tolist()
    predicts = [0] * (bs * n)
    accept_index = [[-1] * num_speculative_tokens for _ in range(bs)]
    accept_num = [0] * bs
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b][0] = last
        cur = 0
        for j in range(1, num_speculative_tokens):
            cur = nxt[b][cur]
            target = tgt[last]
            while cur != -1 and cand[b][cur] != target:
                cur = sib[b][cur]
            if cur == -1:
                break
            predicts[last] = target
            accept_num[b] += 1
            last = ridx[b][cur]
            accept_index[b][j] = last
        predicts[last] = tgt[last]
    return torch.tensor(predicts), torch.tensor(accept_index), torch.tensor(accept_num)


def greedy_verify(tree: TokenTree, target_argmax: torch.Tensor) -> VerifyResult:
    """One request. target_argmax [N]: the target's argmax at each node."""
    n = tree.num_nodes
    _, accept_index, accept_num = verify_tree_greedy(
        tree.draft_tokens[None],
        torch.arange(n)[None],
        tree.retrieve_next_token[None],
        tree.retrieve_next_sibling[None],
        target_argmax.reshape(1, n),
        n,
    )
    nodes = accept_index[0, : int(accept_num[0]) + 1].tolist()
    tokens = [int(tree.draft_tokens[i]) for i in nodes[1:]] + [int(target_argmax[nodes[-1]])]
    return VerifyResult(nodes, tokens)


def coupled_verify(tree: TokenTree, target_probs, seed: int) -> VerifyResult:
    """One seeded request (see the module docstring). target_probs: a function node -> [V] (only
    the accepted path and one more node are visited)."""
    nodes, tokens, node = [0], [], 0
    while True:
        target = seeded_sample(target_probs(node), seed, int(tree.positions[node]) + 1)
        child = int(tree.retrieve_next_token[node])
        while child != -1 and int(tree.draft_tokens[child]) != target:
            child = int(tree.retrieve_next_sibling[child])
        tokens.append(target)
        if child == -1:
            return VerifyResult(nodes, tokens)
        nodes.append(child)
        node = child


def sampling_verify(tree: TokenTree, target_probs, generator: torch.Generator | None) -> VerifyResult:
    """One request. target_probs: [N, V] tensor of the target's processed distribution at each node,
    or a function node -> [V] (the walk visits only the accepted path and one more node, so the
    engine computes probabilities for those alone: top-p over a 49k vocab is not free on CPU)."""
    probs_at = target_probs if callable(target_probs) else target_probs.__getitem__
    nodes = [0]
    tokens: list[int] = []
    node = 0
    while True:
        base = probs_at(node)
        p = base.double().clone()
        child = int(tree.retrieve_next_token[node])
        accepted = -1
        while child != -1:
            x = int(tree.draft_tokens[child])
            q = None if tree.draft_probs is None else tree.draft_probs[child].double()
            qx = 1.0 if q is None else float(q[x])
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if qx > 0 and u * qx < p[x]:  # u < p(x)/q(x), division-free
                accepted = child
                break
            if q is None:
                p[x] = 0.0
            else:
                p = (p - q).clamp_(min=0.0)
            total = p.sum()
            if total <= 0:  # p was covered by q exactly: the residual is undefined, fall back to p
                p = base.double().clone()
            else:
                p /= total
            child = int(tree.retrieve_next_sibling[child])
        if accepted == -1:
            tokens.append(int(torch.multinomial(p.float(), 1, generator=generator)))
            return VerifyResult(nodes, tokens)
        nodes.append(accepted)
        tokens.append(int(tree.draft_tokens[accepted]))
        node = accepted
