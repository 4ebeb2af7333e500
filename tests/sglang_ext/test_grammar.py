"""Structured output masks: per-path rows in a tree (hand-built on the SmolLM2 tokenizer), bad grammars, grammars
over the limits, grammars that match no text."""

import json

import pytest
import torch

from sglang_ext.grammar import (
    JSON_OBJECT,
    GrammarLimits,
    Grammars,
    GrammarSpec,
    apply_bitmask,
    check_limits,
    dead_rules,
    tree_bitmask,
)
from sglang_ext.models.loader import load_tokenizer, resolve_target
from sglang_ext.sampling import InvalidRequest, SamplingParams
from sglang_ext.tree import chain_tree, tree_from_parents

VOCAB, EOS = 49152, 2
SPACE, ONE, X, CLOSE, COMMA, TWO = 216, 33, 1792, 109, 28, 34  # ' ', '1', ' x', '}', ',', '2'


@pytest.fixture(scope="module")
def grammars():
    return Grammars(load_tokenizer(resolve_target("smollm2")), VOCAB, [EOS])


def _fresh_row(grammars, spec, tokens):
    m = grammars.matcher(spec)
    assert all(m.accept_token(t) for t in tokens)
    return tree_bitmask(m, chain_tree(0, [], 0), VOCAB)[0]


def test_tree_rows_follow_their_own_path(grammars):
    spec = JSON_OBJECT
    committed = [39428, 81, 1799]  # {"a":
    m = grammars.matcher(spec)
    assert all(m.accept_token(t) for t in committed)
    #  root(':') ─┬─ 1 ' ' ── 3 '1' ─┬─ 4 '}' ── 6 EOS ── 7 ','   (nothing follows a stop token)
    #             │                  └─ 5 '2'
    #             └─ 2 ' x'                                       (not JSON: its branch ends)
    #                └─ 8 '1'
    tokens = torch.tensor([1799, SPACE, X, ONE, CLOSE, TWO, EOS, COMMA, ONE])
    parents = torch.tensor([-1, 0, 0, 1, 3, 3, 4, 6, 2])
    tree = tree_from_parents(tokens, parents, seq_len=10)
    root_before = _fresh_row(grammars, spec, committed)
    rows = tree_bitmask(m, tree, VOCAB)
    for node in (0, 1, 3, 4, 5):
        path = [int(tokens[j]) for j in tree.path_to(node)[1:]]
        assert torch.equal(rows[node], _fresh_row(grammars, spec, committed + path)), node
    for node in (2, 6, 7, 8):  # unreachable: left open
        assert bool((rows[node] == -1).all()), node
    assert torch.equal(tree_bitmask(m, chain_tree(0, [], 0), VOCAB)[0], root_before)  # the matcher is back where it was
    # what the rows allow: after {"a": the root row refuses ' x'; after {"a": 1} only the stop token
    logits = apply_bitmask(torch.zeros(tree.num_nodes, VOCAB), rows)
    assert logits[0, X] == float("-inf") and logits[0, SPACE] == 0 and logits[0, ONE] == 0
    assert logits[4].isfinite().nonzero().flatten().tolist() == [EOS]
    assert logits[3, CLOSE] == 0 and logits[3, TWO] == 0 and logits[3, EOS] == float("-inf")


def test_json_schema_rows(grammars):
    spec = GrammarSpec(
        "json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    )
    row = apply_bitmask(torch.zeros(1, VOCAB), tree_bitmask(grammars.matcher(spec), chain_tree(0, [], 0), VOCAB))[0]
    allowed = row.isfinite().nonzero().flatten().tolist()
    assert 0 < len(allowed) < 100 and all(t != EOS for t in allowed)  # an object must start; it cannot end yet


@pytest.mark.parametrize(
    "spec,words,param",
    [
        (GrammarSpec("json_schema", "{not json"), "invalid json schema", "response_format"),
        (GrammarSpec("regex", "([a"), "invalid regex", "regex"),
        (GrammarSpec("ebnf", "root ::= "), "invalid ebnf", "ebnf"),
    ],
)
def test_bad_grammars_name_their_parameter(grammars, spec, words, param):
    with pytest.raises(InvalidRequest, match=words) as e:
        grammars.compile(spec)
    assert e.value.param == param and "/project/" not in str(e.value)


def test_bad_grammar_specs():
    with pytest.raises(InvalidRequest, match="kind"):
        GrammarSpec("xml", "<a/>")
    with pytest.raises(InvalidRequest, match="source"):
        GrammarSpec("regex", "")
    with pytest.raises(InvalidRequest, match="ignore_eos") as e:
        SamplingParams(grammar=JSON_OBJECT, ignore_eos=True)
    assert e.value.param == "ignore_eos"


@pytest.mark.parametrize(
    "spec,words",
    [
        (GrammarSpec("json_schema", json.dumps({"enum": list(range(40_000))})), "40000 enum and const values"),
        (
            GrammarSpec("json_schema", json.dumps({"properties": {f"p{i}": {"const": i} for i in range(1001)}})),
            "1001 enum",
        ),
        (GrammarSpec("json_schema", json.dumps({"oneOf": [{"type": "integer"}] * 1001})), "1001 alternatives"),
        (GrammarSpec("json_schema", json.dumps({"items": [[0]] * 10_000})), "20002 values"),
        (GrammarSpec("json_schema", "[" * 65 + "]" * 65), "65 levels of nesting"),
        (GrammarSpec("json_schema", json.dumps({"description": "x" * 100_000})), "characters"),
        (GrammarSpec("regex", "(" * 65 + "a" + ")" * 65), "65 levels of parentheses"),
        (GrammarSpec("regex", "|".join(["a"] * 1002)), "1001 alternatives"),
        (GrammarSpec("ebnf", "root = " + " | ".join(['"a"'] * 1002), "ebnf"), "1001 alternatives"),
    ],
)
def test_grammars_over_a_limit_are_refused_before_compiling(grammars, spec, words):
    with pytest.raises(InvalidRequest, match=words) as e:
        grammars.compile(spec)
    assert (e.value.param, e.value.code) == (spec.param, "grammar_too_complex")


def test_limits_count_what_a_grammar_holds_not_its_literals(grammars):
    # parentheses and '|' inside EBNF strings and character classes, or escaped, are text, not structure
    text = "root ::= " + " ".join(['"((|"'] * 400 + ["[(|]"] * 700)
    assert grammars.compile(GrammarSpec("ebnf", text)) is not None
    assert grammars.compile(GrammarSpec("regex", "[(|]" * 700 + "\\(" * 70 + "\\|" * 1001)) is not None
    assert check_limits(GrammarSpec("json_schema", json.dumps({"enum": list(range(1000))})), GrammarLimits()) is None


@pytest.mark.parametrize(
    "spec,words",
    [
        (GrammarSpec("json_schema", '{"$ref": "#"}'), "grammar matches no text"),
        (GrammarSpec("json_schema", '{"type": "array", "items": {"$ref": "#"}, "minItems": 1}'), "matches no text"),
        (GrammarSpec("ebnf", "root ::= root"), "grammar matches no text"),
        (GrammarSpec("ebnf", 'root ::= x{1,3} "b"\nx ::= "a" x'), "grammar matches no text"),
        (GrammarSpec("regex", "[^\\x00-\\U0010FFFF]"), "grammar matches no text"),
        # text exists ("b"), but an output that starts with "a" could never end
        (GrammarSpec("ebnf", 'root ::= "a" x | "b"\nx ::= x "c"'), "rule 'x' matches no text"),
    ],
)
def test_a_grammar_that_matches_no_text_is_the_clients_error(grammars, spec, words):
    with pytest.raises(InvalidRequest, match=words) as e:
        grammars.compile(spec)
    assert e.value.param == spec.param


@pytest.mark.parametrize(
    "source",
    [
        '{"type": "object", "properties": {"next": {"$ref": "#"}}}',  # recursion with a way out
        '{"type": "array", "items": {"$ref": "#"}}',
        '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}',
    ],
)
def test_recursive_grammars_that_can_end_compile(grammars, source):
    assert grammars.compile(GrammarSpec("json_schema", source)) is not None


def test_the_check_reads_xgrammar_grammars():
    """dead_rules reads xgrammar's serialized grammars: pinned on grammars with and without dead rules, so a
    change of that form fails here rather than letting grammars that never end through unchecked."""
    import xgrammar as xgr

    assert dead_rules(xgr.Grammar.builtin_json_grammar()) == []
    assert dead_rules(xgr.Grammar.from_ebnf("root ::= root")) == [""]
    assert dead_rules(xgr.Grammar.from_ebnf('root ::= "a" y | "b"\ny ::= "c" z\nz ::= z')) == ["y", "z"]
    assert dead_rules(xgr.Grammar.from_ebnf('root ::= x* "b"\nx ::= x')) == ["x"]
