"""Lookahead decoding (Fu et al., 2024) as a training-free drafter: a Jacobi window plus an n-gram pool.

The paper runs two branches in one forward: a lookahead branch (a 2-D window of W guessed future tokens
over N-1 Jacobi iterations) whose outputs only feed an n-gram pool, and a verification branch of pool
n-grams that start with the last token. In this engine one step is one tree verify, so:

- The window is a chain from the root (the "spine"): guesses y_1..y_L for positions root+1..root+L,
  L = min(W, tree depth). The target's argmax at spine node k (which it computes anyway to verify) is the
  Jacobi update of the guess at position root+k+1, so one verify is one Jacobi iteration, and the window
  is verified as a draft too (a converged window is accepted outright). The drafter reads those argmaxes
  through `TargetCapture.tree_argmax` (`wants_tree_argmax = True`).
- The verification branch: pool n-grams whose first token is the root; their N-1 following tokens are
  merged into a trie (ngram.trie_tree) with the spine, within the TreeShape's topk and node budget (with
  topk > 1 the spine is cut short so that one more candidate fits). The most recent candidate also seeds
  the spine's head (the spine is then at least N-1 long, whatever W): a chain shape has room for one
  branch only, and a pool n-gram is a better guess than a Jacobi guess made after a rejected token.
  (Jacobi converges from any guess; a better guess only converges sooner.)
- N-gram collection follows the paper's diagonal, in absolute positions: with y^s the spine of iteration
  s (root included) and z^s its argmaxes (z^s_{q+1} follows y^s_q), the n-gram is
  (y^{t-N+2}_q, y^{t-N+3}_{q+1}, ..., y^t_{q+N-2}, z^t_{q+N-1}), kept only where each link holds
  (y^{s+1}_{q+1} == z^s_{q+1}), so every token is the target's prediction after the one before it.
  Links break where the spine head was taken from the pool or a position was refilled; that n-gram is
  skipped. The request's own text (prompt and output, as prompt lookup does) adds its n-grams too.
- After a step the window shifts: guesses at positions up to the new root leave, the Jacobi updates
  replace the rest, and the tail is refilled from the pool (the most recent n-gram after the previous
  guess) or, failing that, with a random token of the request (the paper initialises from the prompt).

The pool is per request (one request's text never shapes another's drafts) and keeps the POOL_PER_KEY
most recent n-grams per first token. Proposals are point masses (no draft_probs), which the verifier
treats losslessly under sampling as for ngram/suffix; under sampling the window still iterates on the
target's argmax (drafts never change the output, only the speed).

Registry names: `lookahead` (W=DEFAULT_WINDOW, N=DEFAULT_NGRAM) and `lookahead-wW-nN` (either part
optional, e.g. `lookahead-w7-n3`); a colon would clash with the bench's `method:tree` syntax.
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from ..tree import TokenTree, TreeShape
from .base import Drafter, DraftInput, TargetCapture
from .ngram import trie_tree

# NOTE: a short window and a chain: on a CPU a longer window or side branches raise tau a little but cost
# more verify rows than they save (docs/BENCHMARKS.md, lookahead)
DEFAULT_WINDOW, DEFAULT_NGRAM = 3, 4
POOL_PER_KEY = 8  # n-grams kept per first token, most recent first (the paper's G is ~W)
_SPEC = re.compile(r"lookahead(?:-w(\d+))?(?:-n(\d+))?")
SPEC_USAGE = "lookahead[-wW][-nN] (window W >= 1, n-gram size N >= 2; e.g. lookahead-w5-n4)"


def parse_spec(name: str | None) -> tuple[int, int] | None:
    """'lookahead[-wW][-nN]' -> (W, N); None for a name that is not a lookahead spec.
    Raises ValueError for a malformed one ('lookahead:5,4', 'lookahead-wx')."""
    if not name or not name.startswith("lookahead"):
        return None
    m = _SPEC.fullmatch(name)
    window = int(m.group(1) or DEFAULT_WINDOW) if m else 0
    ngram = int(m.group(2) or DEFAULT_NGRAM) if m else 0
    if window < 1 or ngram < 2:
        raise ValueError(f"bad lookahead drafter {name!r}: use {SPEC_USAGE}")
    return window, ngram


def lookahead_tree(window: int = DEFAULT_WINDOW, ngram: int = DEFAULT_NGRAM) -> TreeShape:
    """A chain as long as the spine (the window, or a candidate if longer). On a CPU each verify row
    costs ~15-25 % of a decode, and side branches (--tree d,2,n) lost to the chain for every W, N tried."""
    return TreeShape.chain(max(window, ngram - 1))


class NgramPool:
    """n-grams by first token: the POOL_PER_KEY most recently seen continuations of each."""

    def __init__(self, per_key: int = POOL_PER_KEY):
        self.per_key = per_key
        self._by_first: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: list[int] | tuple[int, ...]) -> None:
        conts = self._by_first.setdefault(gram[0], OrderedDict())
        cont = tuple(gram[1:])
        conts.pop(cont, None)
        conts[cont] = None  # most recent last
        if len(conts) > self.per_key:
            conts.popitem(last=False)

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        """Continuations of `first`, most recent first."""
        return list(reversed(self._by_first.get(first, ())))


Level = tuple[dict[int, int], dict[int, int]]  # (position -> spine token, position -> target argmax there)


def diagonal_ngrams(history: list[Level], n: int) -> list[list[int]]:
    """The diagonal n-grams of the last n-1 Jacobi iterations (oldest first; see the module docstring)."""
    if len(history) < n - 1:
        return []
    history = history[len(history) - (n - 1) :]
    grams = []
    for q, tok in history[0][0].items():
        gram = [tok]
        for j, (_, z) in enumerate(history):
            nxt = z.get(q + j + 1)
            if nxt is None or (j + 1 < len(history) and history[j + 1][0].get(q + j + 1) != nxt):
                break
            gram.append(nxt)
        if len(gram) == n:
            grams.append(gram)
    return grams


def sequence_ngrams(tokens: list[int], n: int, start: int = 0) -> list[list[int]]:
    """The n-grams of `tokens` whose last token is at index `start` or later, in order."""
    return [tokens[end - n : end] for end in range(max(start + 1, n), len(tokens) + 1)]


@dataclass
class _Proposal:
    root_pos: int
    nodes: list[int]  # the spine's node indices in the tree, root first
    tokens: list[int]  # their tokens
    num_nodes: int


@dataclass
class _State:
    pool: NgramPool
    rng: random.Random
    history: deque  # the last N-1 iterations' Levels, oldest first
    guess: dict[int, int] = field(default_factory=dict)  # absolute position -> guessed token (the window)
    indexed: int = 0  # tokens of the request whose n-grams are in the pool
    pending: _Proposal | None = None  # the tree proposed this step, until its commit


class LookaheadDrafter(Drafter):
    name = "lookahead"
    wants_tree_argmax = True  # the Jacobi update reads the target's argmax at every node (TargetCapture)

    def __init__(self, window: int = DEFAULT_WINDOW, ngram: int = DEFAULT_NGRAM, pool_per_key: int = POOL_PER_KEY):
        if window < 1 or ngram < 2:
            raise ValueError(f"lookahead needs window >= 1 and ngram >= 2, got {window}, {ngram}")
        self.window, self.ngram, self.pool_per_key = window, ngram, pool_per_key
        self._states: dict[int, _State] = {}

    def add_request(self, rid: int, capture: TargetCapture) -> None:
        st = self._state(rid)
        self._index(st, capture.token_ids)

    def remove_request(self, rid: int) -> None:
        self._states.pop(rid, None)

    def _state(self, rid: int) -> _State:
        if rid not in self._states:
            self._states[rid] = _State(NgramPool(self.pool_per_key), random.Random(rid), deque(maxlen=self.ngram - 1))
        return self._states[rid]

    def _index(self, st: _State, tokens: list[int]) -> None:
        """Add the n-grams of the request's text not yet in the pool."""
        for gram in sequence_ngrams(tokens, self.ngram, st.indexed):
            st.pool.add(gram)
        st.indexed = len(tokens)

    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        return [self._tree(d, shape) for d in batch]

    def _tree(self, d: DraftInput, shape: TreeShape) -> TokenTree:
        st = self._state(d.rid)
        self._index(st, d.token_ids)
        root_pos, root = len(d.token_ids) - 1, d.token_ids[-1]
        depth = min(shape.depth, shape.num_draft_tokens - 1)
        cand_len = min(self.ngram - 1, depth)
        cands = [list(c[:cand_len]) for c in st.pool.candidates(root)]
        length = min(max(self.window, cand_len if cands else 0), depth)  # a candidate is never cut by the window
        if shape.topk > 1 and len(cands) > 1:  # room for one more candidate beside the spine
            length = min(length, max(cand_len, shape.num_draft_tokens - 1 - cand_len))
        spine = self._spine(st, d.token_ids, root_pos, cands[0][:length] if cands else [], length)
        # the spine outweighs all candidates together, so it is kept whole; the candidates fill the rest
        weighted = [(spine, len(cands) + 1.0)] + [(c, 1.0 + 1e-3 / (rank + 1)) for rank, c in enumerate(cands)]
        tree = trie_tree(root, d.seq_len, weighted, shape)
        st.pending = _Proposal(root_pos, *_spine_nodes(tree, spine), tree.num_nodes)
        return tree

    def _spine(self, st: _State, tokens: list[int], root_pos: int, head: list[int], length: int) -> list[int]:
        """The window's guesses for positions root+1..root+length: `head` first, then the Jacobi
        guesses, then refills; the window state becomes this spine (plus guesses beyond it)."""
        last = root_pos + max(self.window, length)
        st.guess = {q: t for q, t in st.guess.items() if root_pos < q <= last}
        for k, tok in enumerate(head, 1):
            st.guess[root_pos + k] = tok
        prev = tokens[-1]
        for q in range(root_pos + 1, root_pos + length + 1):
            if q not in st.guess:
                nxt = st.pool.candidates(prev)
                st.guess[q] = nxt[0][0] if nxt else st.rng.choice(tokens)
            prev = st.guess[q]
        return [st.guess[q] for q in range(root_pos + 1, root_pos + length + 1)]

    def commit(self, rid: int, capture: TargetCapture) -> None:
        """One Jacobi iteration: the spine's argmaxes become the next guesses and feed the pool."""
        st = self._states.get(rid)
        if st is None:
            return
        prop, st.pending = st.pending, None
        z = capture.tree_argmax
        # a tree this drafter did not propose (a predicted output's, or a step without speculation) teaches nothing
        if prop is None or z is None or z.numel() != prop.num_nodes or capture.token_ids[:1] != prop.tokens[:1]:
            return
        zs = z[torch.tensor(prop.nodes)].tolist()
        level = (
            {prop.root_pos + k: t for k, t in enumerate(prop.tokens)},
            {prop.root_pos + k + 1: t for k, t in enumerate(zs)},
        )
        st.history.append(level)
        for gram in diagonal_ngrams(list(st.history), self.ngram):
            st.pool.add(gram)
        st.guess.update(level[1])


def _spine_nodes(tree: TokenTree, spine: list[int]) -> tuple[list[int], list[int]]:
    """(node indices, tokens) of the spine's path in `tree`, root first, as far as the tree kept it."""
    toks, parents = tree.draft_tokens.tolist(), tree.parents.tolist()
    nodes = [0]
    for tok in spine:
        nxt = next((i for i in range(nodes[-1] + 1, len(toks)) if parents[i] == nodes[-1] and toks[i] == tok), None)
        if nxt is None:
            break
        nodes.append(nxt)
    return nodes, [toks[i] for i in nodes]
