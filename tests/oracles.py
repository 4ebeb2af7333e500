"""Test oracles: the verifiers in their plainest form, which the product's device forms (sglang_ext/verify.py)
must equal. Host loops over one request's tree, as the module docstring of verify.py states the rules:
greedy_verify (the target's argmax), coupled_verify (seeded sampling: plain seeded decoding's tokens) and
sampling_verify (SpecInfer's multi-step speculative sampling, drawing per trial); and SGLang's greedy tree
verification with its signature (verify_tree_greedy, over the general sibling-list walk: sibling_lists, walk),
which the SGLang parity test runs against SGLang's own kernel."""

from __future__ import annotations

import torch

from sglang_ext.sampling import seeded_sample
from sglang_ext.tree import TokenTree
from sglang_ext.verify import VerifyResult, first_passing_child, greedy_path, to_host


def sibling_lists(
    next_token: torch.Tensor,  # [..., N] first child of each node, -1 if none
    next_sibling: torch.Tensor,  # [..., N] next sibling, -1 if last
) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner [..., N]: the node whose child list holds each node, -1 for none (the root, unlinked
    nodes); rank [..., N]: its place in that list, 0 first). List ranking by pointer doubling."""
    n = next_token.shape[-1]
    ar = torch.arange(n, device=next_token.device).expand_as(next_token)
    wide = next_token.shape[:-1] + (n + 1,)  # column n: where the -1 entries land
    prev = next_token.new_full(wide, -1).scatter_(-1, torch.where(next_sibling >= 0, next_sibling, n), ar)[..., :n]
    owner_of_head = next_token.new_full(wide, -1).scatter_(-1, torch.where(next_token >= 0, next_token, n), ar)
    rank = (prev >= 0).long()
    head = torch.where(prev >= 0, prev, ar)
    for _ in range(max(n - 1, 1).bit_length()):
        back = prev.clamp(min=0)
        rank = rank + torch.where(prev >= 0, rank.gather(-1, back), 0)
        prev = torch.where(prev >= 0, prev.gather(-1, back), -1)
        head = head.gather(-1, head)
    return owner_of_head[..., :n].gather(-1, head), rank


def walk(choice: torch.Tensor, steps: int) -> torch.Tensor:
    """[..., N] choice -> [..., steps] the path from the root (node 0) following it, -1 after its end."""
    cur = choice.new_zeros(choice.shape[:-1] + (1,))
    path = [cur]
    for _ in range(steps - 1):
        cur = torch.where(cur >= 0, choice.gather(-1, cur.clamp(min=0)), -1)
        path.append(cur)
    return torch.cat(path, -1)


def verify_tree_greedy(
    candidates: torch.Tensor,  # [bs, N] node tokens (root first)
    retrieve_index: torch.Tensor,  # [bs, N]
    retrieve_next_token: torch.Tensor,  # [bs, N]
    retrieve_next_sibling: torch.Tensor,  # [bs, N]
    target_predict: torch.Tensor,  # [bs, N] target argmax at each node
    num_speculative_tokens: int,  # max accepted nodes incl. root (SGLang: steps + 1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's greedy tree verification, same outputs, on the inputs' device without host reads.

    Returns predicts [bs*N] (target token written at accepted nodes and the last one, else 0),
    accept_index [bs, num_speculative_tokens] (flat node ids, -1 padded), accept_token_num [bs].
    """
    bs, n = candidates.shape
    flat_target = target_predict.reshape(-1).long()
    target = flat_target[retrieve_index]  # [bs, N] the target's token at each node
    owner, rank = sibling_lists(retrieve_next_token, retrieve_next_sibling)
    ok = candidates == target.gather(1, owner.clamp(min=0))  # a child passes if it is its parent's argmax
    path = walk(first_passing_child(owner, rank, ok), num_speculative_tokens)  # [bs, M] local nodes
    on = path >= 0
    flat = retrieve_index.gather(1, path.clamp(min=0))
    accept_index = torch.where(on, flat, -1)
    predicts = flat_target.new_zeros(bs * n + 1)  # slot bs*n: where the padding's writes go
    predicts.scatter_(0, torch.where(on, flat, bs * n).reshape(-1), flat_target[flat].reshape(-1))
    return predicts[:-1], accept_index, on.sum(1) - 1


def greedy_verify(tree: TokenTree, target_argmax: torch.Tensor) -> VerifyResult:
    """One request. target_argmax [N]: the target's argmax at each node."""
    return to_host([greedy_path(tree, target_argmax)])[0]


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
