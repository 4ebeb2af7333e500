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
import logging
import threading
from dataclasses import dataclass

import torch

from .errors import InvalidRequest
from .tree import TokenTree

log = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "ebnf")
_PARAMS = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf"}  # each kind's API parameter
TOO_COMPLEX = "grammar_too_complex"  # the error code of a grammar over a limit or over its compile budget


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. kind: json_schema (source: the schema as JSON text; "{}" for any
    JSON value), regex, or ebnf (xgrammar's EBNF, as SGLang takes it). param: the API parameter that
    carries it, named in errors (default: the kind's own: response_format, regex, ebnf)."""

    kind: str
    source: str
    param: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequest(
                f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}", "response_format"
            )
        if not self.param:
            object.__setattr__(self, "param", _PARAMS[self.kind])
        if not self.source:
            raise InvalidRequest(f"a {self.kind} grammar needs its source", self.param)


JSON_OBJECT = GrammarSpec("json_schema", '{"type": "object"}')  # OpenAI's response_format json_object


@dataclass(frozen=True)
class GrammarLimits:
    """What a client's grammar may hold, checked before anything is compiled: compile time grows with
    these (xgrammar takes ~14 s for a JSON schema enum of 25,000 strings, 0.01 s for 1,000)."""

    max_chars: int = 100_000  # source text (a JSON schema as JSON text)
    max_depth: int = 64  # arrays and objects inside each other in a schema; parentheses in a regex or EBNF
    max_nodes: int = 20_000  # values in a JSON schema (objects, arrays, strings, numbers, ...)
    max_enum: int = 1_000  # enum and const values in a JSON schema, all together (OpenAI's limit)
    max_alternatives: int = 1_000  # anyOf / oneOf / allOf branches in a schema; '|' in a regex or EBNF


def check_limits(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """InvalidRequest (code grammar_too_complex) naming the parameter and the limit a spec goes over."""
    if spec.kind == "json_schema":
        try:
            nodes, depth, enum, alternatives = _schema_counts(json.loads(spec.source))
        except RecursionError:
            nodes, depth, enum, alternatives = 0, limits.max_depth + 1, 0, 0
        except ValueError as e:
            raise InvalidRequest(f"invalid json schema: {e}", spec.param) from None
        _limit(spec, "enum and const values", enum, limits.max_enum)
        _limit(spec, "values", nodes, limits.max_nodes)
        _limit(spec, "levels of nesting", depth, limits.max_depth)
    else:
        depth, alternatives = _source_counts(spec.source, strings=spec.kind == "ebnf")
        _limit(spec, "levels of parentheses", depth, limits.max_depth)
    _limit(spec, "alternatives", alternatives, limits.max_alternatives)
    _limit(spec, "characters", len(spec.source), limits.max_chars)


def _limit(spec: GrammarSpec, what: str, n: int, most: int) -> None:
    if n > most:
        name = "JSON schema" if spec.kind == "json_schema" else spec.kind
        raise InvalidRequest(
            f"{spec.param}: the {name} has {n} {what}; this server compiles grammars of at most {most}",
            spec.param,
            TOO_COMPLEX,
        )


def _schema_counts(schema) -> tuple[int, int, int, int]:
    """(values, nesting depth, enum + const values, anyOf/oneOf/allOf branches) of a JSON schema."""
    nodes = depth = enum = alternatives = 0
    stack = [(schema, int(isinstance(schema, (dict, list))))]
    while stack:
        value, level = stack.pop()
        nodes += 1
        depth = max(depth, level)
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in children:
            if key == "enum" and isinstance(child, list):
                enum += len(child)
            elif key == "const":
                enum += 1
            elif key in ("anyOf", "oneOf", "allOf") and isinstance(child, list):
                alternatives += len(child)
            stack.append((child, level + isinstance(child, (dict, list))))
    return nodes, depth, enum, alternatives


def _source_counts(text: str, strings: bool) -> tuple[int, int]:
    """(deepest nesting of parentheses, '|' count) of a regex or EBNF (strings: "..." literals, as in EBNF),
    outside character classes, literals and escapes."""
    depth = level = alternatives = 0
    closer, escaped = "", False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif closer:  # inside a literal or a character class until its closer
            closer = "" if ch == closer else closer
        elif ch == "[" or (ch == '"' and strings):
            closer = "]" if ch == "[" else '"'
        elif ch == "(":
            level += 1
            depth = max(depth, level)
        elif ch == ")":
            level -= 1
        elif ch == "|":
            alternatives += 1
    return depth, alternatives


def parse_grammar(spec: GrammarSpec, limits: GrammarLimits | None):
    """The spec as an xgrammar Grammar, or InvalidRequest naming its parameter: over a limit (checked first;
    limits None: a grammar the server wrote itself from checked parts), not a valid schema, regex or EBNF,
    or a grammar that matches no text."""
    import xgrammar as xgr

    if limits is not None:
        check_limits(spec, limits)
    try:
        if spec.kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(spec.source)
        elif spec.kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.source)
        else:
            grammar = xgr.Grammar.from_ebnf(spec.source)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequest(f"invalid {spec.kind.replace('_', ' ')}: {error_reason(e)}", spec.param) from None
    check_matches_text(grammar, spec.param)
    return grammar


def check_matches_text(grammar, param: str) -> None:
    """InvalidRequest when the grammar accepts no string at all (`{"$ref": "#"}`, `root ::= root`), or holds a
    rule that accepts none where an output can reach it (`root ::= "a" x | "b"`, `x ::= x`): xgrammar would
    let the output enter it and then allow no token, so its request could never end."""
    dead = dead_rules(grammar)
    if not dead:
        return
    if dead[0] == "":
        raise InvalidRequest(f"{param}: grammar matches no text (it can never end)", param)
    raise InvalidRequest(
        f"{param}: grammar rule {dead[0]!r} matches no text, so an output that enters it could never end", param
    )


# xgrammar's grammar expressions (serialized as [type, n, data...]; its grammar_impl.h)
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)
_TOKEN_TAG_DISPATCH = 11
_MAX_CODEPOINT = 0x10FFFF


def dead_rules(grammar) -> list[str]:
    """The names of the rules reachable from the root that derive no finite string, [""] when the root is
    one of them (the grammar matches nothing), [] when every reachable rule can end. Read from the grammar's
    serialized form; a form this reader does not know is taken as all alive (logged), never as a client error."""
    try:
        g = json.loads(grammar.serialize_json())
        exprs = _expressions(g["grammar_expr_data"], g["grammar_expr_indptr"])
        bodies = [rule[1] for rule in g["rules"]]
        alive, root = _productive(exprs, bodies), g["root_rule_id"]
        if not alive[root]:
            return [""]
        return [g["rules"][r][0] for r in _reachable(exprs, bodies, root) if not alive[r]]
    except (KeyError, IndexError, TypeError, ValueError):
        log.warning("xgrammar's grammar form is not the one this check reads; grammar accepted unchecked")
        return []


def _expressions(data: list[int], indptr: list[int]) -> list[tuple[int, list[int]]]:
    return [(data[i], data[i + 2 : i + 2 + data[i + 1]]) for i in indptr]


def _class_nonempty(items: list[int]) -> bool:
    """A character class [negated, lo0, hi0, ...] holds a character."""
    negated, ranges = items[0], sorted(zip(items[1::2], items[2::2]))
    if not negated:
        return any(lo <= hi for lo, hi in ranges)
    covered = -1  # the highest code point covered from 0 on
    for lo, hi in ranges:
        if lo > covered + 1:
            break
        covered = max(covered, hi)
    return covered < _MAX_CODEPOINT


def _productive(exprs: list[tuple[int, list[int]]], bodies: list[int]) -> list[bool]:
    """Which rules derive a finite string: the least fixed point over the AND (sequence, repeat of at least
    one) / OR (choices, rule reference) graph of expressions, one pass along reverse edges (linear)."""
    n = len(exprs)
    missing = [0] * (n + len(bodies))  # children still to be proven (node n + r: rule r)
    parents: list[list[int]] = [[] for _ in missing]
    for i, (kind, items) in enumerate(exprs):
        children: list[int] = []
        if kind == _RULE_REF or (kind == _REPEAT and items[1] > 0):
            children, missing[i] = [n + items[0]], 1
        elif kind == _SEQUENCE:
            children, missing[i] = list(items), len(items)
        elif kind == _CHOICES:
            children, missing[i] = list(items), 1 if items else 1 << 30
        elif kind == _CLASS and not _class_nonempty(items):
            missing[i] = 1 << 30
        for c in children:
            parents[c].append(i)
    for r, body in enumerate(bodies):
        parents[body].append(n + r)
        missing[n + r] = 1
    done = [m == 0 for m in missing]
    work = [i for i, d in enumerate(done) if d]
    while work:
        for p in parents[work.pop()]:
            missing[p] -= 1
            if missing[p] == 0 and not done[p]:
                done[p] = True
                work.append(p)
    return done[n:]


def _reachable(exprs: list[tuple[int, list[int]]], bodies: list[int], root: int) -> list[int]:
    """Rule ids reachable from the root, the root first."""
    seen, order, stack, visited = {root}, [root], [bodies[root]], set()
    while stack:
        e = stack.pop()
        if e in visited:
            continue
        visited.add(e)
        kind, items = exprs[e]
        rules: list[int] = []
        if kind in (_RULE_REF, _REPEAT):
            rules = [items[0]]
        elif kind in (_SEQUENCE, _CHOICES):
            stack.extend(items)
        elif kind == _TAG_DISPATCH:
            rules = items[1:-2:2]
        elif kind == _TOKEN_TAG_DISPATCH:
            rules = items[2 : 1 + 2 * items[0] : 2]
        for r in rules:
            if r not in seen:
                seen.add(r)
                order.append(r)
                stack.append(bodies[r])
    return order


class Grammars:
    """Compiles grammars for one tokenizer and makes a matcher per request.

    In the server the compiling happens in worker processes (serving/backends/grammar_pool.py), which are
    made from this one's tokenizer info (`info_json`, `from_info_json`) and send back serialized compiled
    grammars (`load`); an Engine used on its own compiles here (`compile`)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], limits: GrammarLimits = GrammarLimits()):
        self.vocab_size, self.stop_token_ids, self.limits = vocab_size, sorted(stop_token_ids), limits
        self._tokenizer, self._encoded_vocab = tokenizer, None
        self._info = self._compiler = None
        self._lock = threading.Lock()  # the lazy set-up below may be reached from several threads
        self.cache_bytes = 256 << 20  # xgrammar's own cache of compiled grammars (0: none)

    @classmethod
    def for_vocab(cls, encoded_vocab: list[str], stop_token_ids: list[int]) -> Grammars:
        """From a raw vocabulary (token i's text), for a model without a tokenizer (tests' tiny models)."""
        g = cls(None, len(encoded_vocab), stop_token_ids)
        g._encoded_vocab = list(encoded_vocab)
        return g

    @classmethod
    def from_info_json(cls, info_json: str, limits: GrammarLimits, cache_bytes: int = 0) -> Grammars:
        """The Grammars of another process's `info_json()` (a compile worker's)."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(info_json)
        g = cls(None, info.vocab_size, info.stop_token_ids, limits)
        g._info, g.cache_bytes = info, cache_bytes
        return g

    def info(self):
        """xgrammar's TokenizerInfo (built once: ~1 s for a 49k vocabulary)."""
        with self._lock:
            if self._info is None:
                self._info = self._make_info()
            return self._info

    def _make_info(self):
        import xgrammar as xgr

        if self._encoded_vocab is not None:
            return xgr.TokenizerInfo(self._encoded_vocab, stop_token_ids=self.stop_token_ids)
        if self._tokenizer is None:
            raise InvalidRequest("structured output needs the model's tokenizer", "response_format")
        return xgr.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )

    def info_json(self) -> str:
        return self.info().serialize_json()

    def _get_compiler(self):
        info = self.info()
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                cache = self.cache_bytes > 0
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_enabled=cache, cache_limit_bytes=self.cache_bytes if cache else -1
                )
            return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of a client's spec; InvalidRequest naming the problem (parse_grammar)."""
        return self.compile_parsed(parse_grammar(spec, self.limits))

    def compile_parsed(self, grammar):
        """The compiled form of a Grammar from parse_grammar (the token masks: the costly part)."""
        return self._get_compiler().compile_grammar(grammar)

    def load(self, serialized: str):
        """A compiled grammar that a worker serialized (`compiled.serialize_json()`)."""
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(serialized, self.info())

    def matcher(self, grammar):
        """A fresh matcher of a compiled grammar, or of a spec compiled here."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(grammar) if isinstance(grammar, GrammarSpec) else grammar)


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
