"""The one JSON parser of request bodies (serving/api/body.py): UTF-8 only, depth measured on the raw bytes,
no RecursionError or other exception ever escaping as anything but JSONError, and no string that is not text
(a lone surrogate) reaching a tokenizer."""

from __future__ import annotations

import codecs
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.api.body import MAX_JSON_DEPTH, JSONError, load_field, load_json, nesting_depth
from serving.api.errors import APIError

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


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"])
def test_bodies_that_are_not_utf8_are_refused_before_their_depth_could_be_misread(encoding):
    # U+0122 is the bytes 22 01 in UTF-16-LE: a quote to a byte scanner, hiding the brackets after it
    # (json.loads alone detects UTF-16 and UTF-32 and would decode this: 800 levels)
    deep = '{"a": "\u0122", "b": ' + "[" * 800 + "]" * 800 + "}"
    # bytes that are valid UTF-8 too (UTF-16 without a byte order mark: ASCII, NULs, 0x01) decode to text with
    # NULs in it, which is not JSON
    with pytest.raises(JSONError, match="not UTF-8|not valid JSON") as e:
        load_json(deep.encode(encoding) if encoding != "latin-1" else b'{"a": "\xe9"}')
    assert e.value.code == "invalid_json"
    with pytest.raises(JSONError, match="levels deep"):  # the same document in UTF-8: its depth is seen
        load_json(deep.encode())


def test_a_utf8_byte_order_mark_is_ignored():
    assert load_json(codecs.BOM_UTF8 + b'{"a": [1]}') == {"a": [1]}


@pytest.mark.parametrize(
    "text, param",
    [
        ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        ('{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        ('{"text": "x\\uDBFF"}', "text"),
        ('{"sampling_params": {"stop": ["\\ud83d"]}}', "sampling_params.stop[0]"),
        ('{"tools": [{"function": {"description": "\\ude00 trailing"}}]}', "tools[0].function.description"),
        ('{"logit_bias": {"1\\ud800": 5}}', "logit_bias"),  # a key
        ('"\\ud800"', None),
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_field(text, param):
    with pytest.raises(JSONError, match="lone surrogate") as e:
        load_json(text.encode())
    assert (e.value.param, e.value.code) == (param, "invalid_value")


def test_text_that_only_looks_like_a_surrogate_is_text():
    assert load_json(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "\U0001f600", "b": "\\ud800"}


def test_json_inside_a_string_names_the_string():
    field = "messages[0].tool_calls[0].function.arguments"
    with pytest.raises(APIError) as e:
        load_field('{"city": ["\\ud800"]}', field, "it must be a JSON object")
    assert e.value.param == field and "(at city[0])" in e.value.message
    with pytest.raises(APIError, match="it must be a JSON object") as e:
        load_field("{", field, "it must be a JSON object")
    assert e.value.param == field
