"""Structured output: a grammar (a JSON schema, a regex, EBNF) as a token mask on the target's
logits, with xgrammar (what SGLang uses) matching tokens against it.

Like the penalties, the mask depends on each row's context. A depth-first walk of the tree advances
the request's matcher along root -> node and rolls it back, so row i allows exactly the tokens plain
constrained decoding would allow after that path:

    committed: {"a":          tree:  root ─┬─ ' 1' ── '}'      row of ' 1': after {"a": 1   -> '}', ',', digits
                                           └─ ' x'             ' x' is not JSON: its branch ends (masked at
                                                               the root, so never accepted; its rows stay open)

The matcher then accepts the tokens the request actually appends. Drafters draft without the
grammar: a draft the grammar forbids is simply rejected, so output stays exactly the target's
constrained output (greedy) or distribution (sampling).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from .errors import InvalidRequest
from .tree import TokenTree

KINDS = ("json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. kind: json_schema (source: the schema as JSON text; "{}" for any
    JSON value), regex, or ebnf (xgrammar's EBNF, as SGLang takes it)."""

    kind: str
    source: str

    @property
    def param(self) -> str:
        """The API parameter that carries it (named in errors)."""
        return self.kind if self.kind in ("regex", "ebnf") else "response_format"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequest(
                f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}", "response_format"
            )
        if not self.source:
            raise InvalidRequest(f"a {self.kind} grammar needs its source", self.param)


JSON_OBJECT = GrammarSpec("json_schema", '{"type": "object"}')  # OpenAI's response_format json_object


class Grammars:
    """Compiles grammars for one tokenizer (cached by xgrammar) and makes a matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size, self.stop_token_ids = vocab_size, sorted(stop_token_ids)
        self._tokenizer, self._encoded_vocab = tokenizer, None
        self._compiler = None
        self._lock = threading.Lock()  # the gateway compiles in a worker thread, the engine in its own

    @classmethod
    def for_vocab(cls, encoded_vocab: list[str], stop_token_ids: list[int]) -> Grammars:
        """From a raw vocabulary (token i's text), for a model without a tokenizer (tests' tiny models)."""
        g = cls(None, len(encoded_vocab), stop_token_ids)
        g._encoded_vocab = list(encoded_vocab)
        return g

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            if self._encoded_vocab is not None:
                info = xgr.TokenizerInfo(self._encoded_vocab, stop_token_ids=self.stop_token_ids)
            elif self._tokenizer is None:
                raise InvalidRequest("structured output needs the model's tokenizer", "response_format")
            else:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; InvalidRequest naming the problem for a bad schema, regex or EBNF."""
        with self._lock:
            c = self._get_compiler()
            try:
                if spec.kind == "json_schema":
                    return c.compile_json_schema(spec.source)
                if spec.kind == "regex":
                    return c.compile_regex(spec.source)
                return c.compile_grammar(spec.source)
            except (RuntimeError, ValueError, json.JSONDecodeError) as e:
                raise InvalidRequest(f"invalid {spec.kind.replace('_', ' ')}: {error_reason(e)}", spec.param) from None

    def matcher(self, spec: GrammarSpec):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))


def error_reason(e: Exception) -> str:
    """xgrammar's message without its C++ location and assertion prefixes, at most 300 characters."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    if text.startswith("Check failed:") and " is false: " in text:
        text = text.split(" is false: ", 1)[1]
    return text if len(text) <= 300 else text[:297] + "..."


def tree_bitmask(matcher, tree: TokenTree, vocab_size: int) -> torch.Tensor:
    """[N, ceil(V/32)] int32 allowed-token bits for each node's row (all open where unreachable).
    The matcher is left as it was."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(tree.num_nodes, vocab_size)  # all allowed
    first, sibling, tokens = (
        tree.retrieve_next_token.tolist(),
        tree.retrieve_next_sibling.tolist(),
        tree.draft_tokens.tolist(),
    )

    def visit(node: int) -> None:
        if matcher.is_terminated():  # a stop token ended the output here: nothing follows
            return
        matcher.fill_next_token_bitmask(bitmask, node)
        child = first[node]
        while child != -1:
            if matcher.accept_token(tokens[child]):
                visit(child)
                matcher.rollback(1)
            child = sibling[child]

    visit(0)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """[n, V] logits -> float32 copy with the disallowed tokens at -inf."""
    import xgrammar as xgr

    x = logits.float().contiguous().clone()
    xgr.apply_token_bitmask_inplace(x, bitmask[: x.shape[0]], vocab_size=x.shape[-1])
    return x
