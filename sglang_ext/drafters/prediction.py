"""Predicted outputs (OpenAI's `prediction`) for drafters that do not read them: EAGLE-3, MoA, the draft model.

A request whose last MIN_MATCH or more tokens occur in its predicted output (DraftInput.reference) drafts
what follows them there, as a chain of the step's node budget; the engine sends every other request to the
model drafter. A prediction is usually right for long stretches (an unchanged part of a file being edited),
where a lookup chain beats a model's few tokens at no drafting cost. The lookup drafters (n-gram, suffix)
search the prediction themselves (`reads_reference`) and need none of this.
"""

from __future__ import annotations

from ..tree import TokenTree, TreeShape
from .base import DraftInput
from .ngram import FULL_CONFIDENCE_MATCH, NgramDrafter, by_recency, trie_tree

# NOTE: below this many matched tokens a lookup's next token was accepted < 50 % of the time (ngram.py),
# while the model drafter's own proposal is the better bet
MIN_MATCH = FULL_CONFIDENCE_MATCH


class PredictionLookup:
    def __init__(self, min_match: int = MIN_MATCH, max_ngram: int = 4):
        self.ngram = NgramDrafter(
            max_ngram=max_ngram, min_ngram=min_match
        )  # matches shorter than min_match are not tried

    def trees(self, batch: list[DraftInput], shape: TreeShape) -> dict[int, TokenTree]:
        """rid -> a chain from the prediction, for the requests of `batch` whose tail matches theirs."""
        out: dict[int, TokenTree] = {}
        depth = shape.num_draft_tokens - 1  # the same KV budget as the step's trees
        for d in batch:
            if not d.reference:
                continue
            _, conts = self.ngram.longest_match(d.token_ids, depth, d.reference, own=False)
            if conts:
                out[d.rid] = trie_tree(d.token_ids[-1], d.seq_len, by_recency(conts), TreeShape.chain(depth))
        return out
