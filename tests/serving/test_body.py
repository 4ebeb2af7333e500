"""The one JSON parser of request bodies (serving/api/body.py): depth measured on the raw bytes, no
RecursionError or other exception ever escaping as anything but JSONError."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.api.body import MAX_JSON_DEPTH, JSONError, load_json, nesting_depth

# strings full of what could fool a scanner: brackets, quotes, backslashes
TRICKY = st.text(alphabet=st.sampled_from('[]{}"\\ a\n\u00e9'), max_size=12)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), TRICKY),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TRICKY, inner, max_size=4)),
    max_leaves=30,
)


def depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(depth, v.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None, database=None)
@given(JSON_VALUES, st.booleans(), st.sampled_from([None, 2]))
def test_depth_on_raw_bytes_equals_the_decoded_depth(value, ascii_only, indent):
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert nesting_depth(text.encode()) == depth(value)
    assert load_json(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,  # Python's decoder would raise RecursionError
        '{"a": ' * 50_000 + "1" + "}" * 50_000,
        "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1),
        "[" * 100_000,  # unbalanced
    ],
)
def test_deep_nesting_is_refused_before_decoding(text):
    with pytest.raises(JSONError, match="levels deep"):
        load_json(text)


def test_the_limit_itself_is_accepted():
    assert depth(load_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)) == MAX_JSON_DEPTH
    assert load_json('["' + "[" * 100_000 + '"]') == ["[" * 100_000]  # brackets inside a string are text


@pytest.mark.parametrize(
    "text", ["", "{", "[NaN]", '{"a": Infinity}', "-Infinity", "1" * 5000, b"\xff\xfe", b'"\xc3"', "[1,]"]
)
def test_malformed_text_is_a_json_error(text):
    with pytest.raises(JSONError):
        load_json(text)
