"""Suffix drafter: n-gram lookup in the request itself plus a corpus of the target's past outputs.

The idea of SuffixDecoding (Oliaro et al., 2024): a model's answers repeat phrases across
requests ("Here is a Python function that", "Let's break it down step by step"), so the
continuations of the context's tail in a corpus of the *target's own* earlier outputs are good
drafts, at the cost of a few binary searches. Candidates come from three places and are merged
into one trie weighted by their empirical probability:

- the request's own prompt and output (the plain n-gram drafter's lookup),
- a seed corpus shipped with the drafter (target answers from `moa-serve distill`),
- an online corpus of outputs this process generated (finished requests; bounded, oldest dropped).

A corpus match no longer than the request's own match counts half: the request is the better
evidence. Proposals are deterministic, so verification stays lossless under sampling. The online
corpus makes one request's outputs shape another's *drafts* (never its output, but its speed: a
timing channel), so it is kept per tenant (DraftInput.tenant: the API key and cache_salt, as the
engine's prefix cache is): a request drafts from its own tenant's answers only. Turn it off with
`online=False` / MOA_SERVE_SUFFIX_ONLINE=0.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np

from ..models.checkpoint import CONFIG, SUFFIX_CORPUS, CheckpointError, read_config
from ..settings import settings
from ..tree import TokenTree, TreeShape
from .base import DraftInput, TargetCapture
from .ngram import NgramDrafter, match_confidence, trie_tree
from .shipped import shipped_path
from .suffix_index import SuffixIndex

CORPUS_FILE = "corpus.npz"


class CorpusError(CheckpointError):
    """A suffix corpus is missing, malformed, or made for another tokenizer."""


def save_corpus(out: str | Path, docs: list[list[int]], meta: dict) -> Path:
    """Write docs (token id lists) as one flat array (uint16 when the vocab fits) + offsets,
    with a config.json of `meta`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    docs = [d for d in docs if len(d)]
    flat = np.fromiter((t for d in docs for t in d), dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= meta.get("vocab_size", 2**31)):
        raise CorpusError("token ids outside the vocabulary")
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    dtype = np.uint16 if meta.get("vocab_size", 2**31) <= 2**16 else np.uint32
    np.savez_compressed(out / CORPUS_FILE, tokens=flat.astype(dtype), offsets=offsets)
    meta = {"kind": SUFFIX_CORPUS, **meta, "num_docs": len(docs), "num_tokens": int(flat.size)}
    (out / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_corpus(path: str | Path, vocab_size: int | None = None) -> tuple[list[np.ndarray], dict]:
    path = Path(path)
    try:
        meta = read_config(path)
        with np.load(path / CORPUS_FILE) as z:
            tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
    except (OSError, ValueError, KeyError) as e:  # CheckpointError (config.json) is a ValueError
        raise CorpusError(f"{path}: not a suffix corpus ({CONFIG} + {CORPUS_FILE}): {e}") from None
    if (
        offsets.ndim != 1
        or offsets.size < 1
        or offsets[0] != 0
        or offsets[-1] != tokens.size
        or (np.diff(offsets) < 0).any()
    ):
        raise CorpusError(f"{path}: offsets do not partition the tokens")
    if vocab_size is not None:
        if meta.get("vocab_size") != vocab_size:
            raise CorpusError(
                f"{path}: corpus made for a vocabulary of {meta.get('vocab_size')} ids, the target has {vocab_size}"
            )
        if tokens.size and tokens.max() >= vocab_size:
            raise CorpusError(f"{path}: token ids outside the target's vocabulary")
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])], meta


MAX_MATCH = 8  # the longest context tail a corpus lookup matches (the index's key length)
_INDEXES: dict[tuple, tuple[tuple[int, int], SuffixIndex]] = {}  # key -> (file stamp, index)


def corpus_index(path: str | Path, vocab_size: int | None, key_len: int) -> SuffixIndex:
    """The suffix index of the corpus at `path`, built once per process for the file as it is (path, size and
    modification time): building sorts every suffix of the corpus (~1 s for the shipped one), and an index is
    read only, so every drafter made from the same corpus shares it."""
    path = Path(path)
    try:
        st = (path / CORPUS_FILE).stat()
    except OSError as e:
        raise CorpusError(f"{path}: not a suffix corpus ({CONFIG} + {CORPUS_FILE}): {e}") from None
    key, stamp = (str(path.resolve()), vocab_size, key_len), (st.st_size, st.st_mtime_ns)
    if key not in _INDEXES or _INDEXES[key][0] != stamp:  # (a corpus rewritten in place replaces its index)
        docs, _ = load_corpus(path, vocab_size)
        _INDEXES[key] = (stamp, SuffixIndex(docs, key_len=key_len))
    return _INDEXES[key][1]


def shipped_corpus(target) -> Path:
    """The suffix corpus shipped in drafters/ for this target (CorpusError when none is)."""
    return shipped_path(target, "suffix", error=CorpusError)


class OnlineCorpus:
    """One tenant's online corpus: its documents and their index (rebuilt after ~25 % growth: amortised)."""

    def __init__(self, key_len: int):
        self.key_len = key_len
        self.docs: deque[list[int]] = deque()
        self.tokens = 0
        self.index: SuffixIndex | None = None
        self._indexed = 0  # tokens in the index

    def add(self, doc: list[int]) -> None:
        self.docs.append(doc)
        self.tokens += len(doc)
        if self.tokens > 1.25 * self._indexed:
            self.index = SuffixIndex(list(self.docs), key_len=self.key_len)
            self._indexed = self.tokens

    def drop_oldest(self) -> None:
        self.tokens -= len(self.docs.popleft())


class SuffixDrafter(NgramDrafter):
    name = "suffix"

    def __init__(
        self,
        seed_docs: list | SuffixIndex | None = None,
        max_match: int = MAX_MATCH,
        min_corpus_match: int = 1,
        max_samples: int = 64,
        online: bool = True,
        max_online_tokens: int = 1_000_000,
        min_share: float = 0.3,
        **ngram_kw,
    ):
        super().__init__(**ngram_kw)
        self.min_share = min_share  # leave out nodes with less than this share of the evidence
        self.max_match, self.min_corpus_match, self.max_samples = max_match, min_corpus_match, max_samples
        # seed_docs: documents, or a built index of them (read only here: drafters may share one)
        if isinstance(seed_docs, SuffixIndex):
            if seed_docs.key_len != max_match:
                raise ValueError(f"a seed index of key_len {seed_docs.key_len} for max_match {max_match}")
            self.seed = seed_docs
        else:
            self.seed = SuffixIndex(seed_docs or [], key_len=max_match)
        self.online, self.max_online_tokens = online, max_online_tokens
        self.corpora: dict[str, OnlineCorpus] = {}  # tenant -> its online corpus
        self._order: deque[str] = deque()  # the tenant of each online document, oldest first (the cap drops it)
        self._online_tokens = 0  # tokens in all online corpora
        self._prompt_len: dict[int, int] = {}
        self._last_seq: dict[int, tuple[str, list[int]]] = {}  # rid -> (tenant, sequence at its last propose)

    def stop_learning(self) -> None:
        self.online = False

    @classmethod
    def from_target(cls, target, path: str | Path | None = None, **kw) -> "SuffixDrafter":
        """The shipped corpus for `target` (or the one at `path`);
        MOA_SERVE_SUFFIX_ONLINE=0 turns off online learning."""
        kw.setdefault("online", settings().suffix_online)
        index = corpus_index(path or shipped_corpus(target), target.cfg.vocab_size, kw.get("max_match", MAX_MATCH))
        return cls(index, **kw)

    # -- request lifecycle: remember each request's sequence so its output can join the online corpus
    def add_request(self, rid: int, capture: TargetCapture) -> None:
        self._prompt_len[rid] = len(capture.token_ids)

    def remove_request(self, rid: int) -> None:
        (tenant, seq), n_prompt = self._last_seq.pop(rid, ("", None)), self._prompt_len.pop(rid, None)
        if self.online and seq is not None and n_prompt is not None and len(seq) > n_prompt:
            self.add_output(seq[n_prompt:], tenant)

    def add_output(self, tokens: list[int], tenant: str = "") -> None:
        """Add a generated output to its tenant's online corpus (the oldest documents of all tenants dropped past
        the cap)."""
        if tenant not in self.corpora:
            self.corpora[tenant] = OnlineCorpus(self.max_match)
        self.corpora[tenant].add(list(tokens))
        self._order.append(tenant)
        self._online_tokens += len(tokens)
        while self._online_tokens > self.max_online_tokens and len(self._order) > 1:
            oldest = self._order.popleft()
            corpus = self.corpora[oldest]
            self._online_tokens -= len(corpus.docs[0])
            corpus.drop_oldest()
            if not corpus.docs:  # (a tenant whose documents all went keeps no corpus)
                del self.corpora[oldest]

    @property
    def online_docs(self) -> list[list[int]]:
        """Every tenant's online documents."""
        return [d for c in self.corpora.values() for d in c.docs]

    def propose(self, batch: list[DraftInput], shape: TreeShape) -> list[TokenTree]:
        for d in batch:
            self._last_seq[d.rid] = (d.tenant, d.token_ids)
        return [self._tree(d, shape) for d in batch]

    def candidates(
        self, ctx: list[int], depth: int, reference: list[int] = (), tenant: str = ""
    ) -> tuple[int, list[tuple[list[int], float]]]:
        """(length of the request's own longest match, weighted continuations of up to `depth` tokens
        from the request itself (and its predicted output), the seed corpus and its tenant's online corpus):
        what a tree is built from."""
        own_len, own = self.longest_match(ctx, depth, reference)
        weighted = [(c, 1.0 / len(own) + 1e-3 / (rank + 1)) for rank, c in enumerate(own)]  # ties: most recent
        online = self.corpora.get(tenant)
        for index in (self.seed, online.index if online is not None else None):
            if index is None or not len(index):
                continue
            m = index.lookup(ctx, depth, self.max_match, self.min_corpus_match, self.max_samples)
            if m.continuations:
                scale = 1.0 if m.length > own_len else 0.5
                weighted += [(c, scale / len(m.continuations)) for c in m.continuations]
        return own_len, weighted

    def _tree(self, d: DraftInput, shape: TreeShape) -> TokenTree:
        own_len, weighted = self.candidates(d.token_ids, shape.depth, d.reference, d.tenant)
        # the request's own match sets the confidence: a long corpus match alone predicted acceptance
        # no better than a short one (scripts/lookup-acceptance.py; docs/BENCHMARKS.md, "Tree shapes")
        return trie_tree(d.token_ids[-1], d.seq_len, weighted, shape, self.min_share, match_confidence(own_len))
