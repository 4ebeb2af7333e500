"""Tool calling without a model: request checks, the prompt rendering, the call grammar, and the
reader that splits (streamed) output into content and calls."""

import json
import random

import pytest
import xgrammar as xgr

from serving.api.errors import APIError
from serving.api.tools import (
    CLOSE,
    OPEN,
    ToolCallReader,
    call_grammar,
    parse_tools,
    render_messages,
    split_output,
    tool_grammar,
)
from sglang_ext.errors import InvalidRequest
from sglang_ext.grammar import GrammarLimits

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "root"]}},
    "required": ["city"],
    "additionalProperties": False,
}
LIMITS = GrammarLimits()
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: takes {}
]


def setup(choice=None, parallel=None):
    return parse_tools(TOOLS, choice, parallel)


def call(name, arguments) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def test_parse_tools_and_choices():
    assert parse_tools(None, None, None) is None and parse_tools(TOOLS, "none", None) is None
    t = setup()
    assert t.choice == "auto" and t.parallel and t.names == {"get_weather", "ping"}
    assert t.functions[1].parameters == {"type": "object", "properties": {}}
    assert setup("required", False).choice == "required" and not setup("required", False).parallel
    assert setup({"type": "function", "function": {"name": "ping"}}).choice == "ping"
    assert tool_grammar(t.payload(), LIMITS) is None  # auto: the model decides
    assert tool_grammar(setup("required").payload(), LIMITS).kind == "ebnf"


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        (None, "auto", "tool_choice"),
        ([{"type": "retrieval"}], None, "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "a", "description": 3}}], None, "tools[0].function.description"),
        ([{"type": "function", "function": {"name": "a", "parameters": []}}], None, "tools[0].function.parameters"),
        (TOOLS + TOOLS[:1], None, "tools"),
        ([TOOLS[1]] * 129, None, "tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice"),
    ],
)
def test_bad_tools_name_their_parameter(tools, choice, param):
    with pytest.raises(APIError) as e:
        parse_tools(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize(
    "parameters, words",
    [
        ({"type": "integer", "minimum": "x"}, "invalid json schema"),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "matches no text"),
        ({"enum": list(range(1001))}, "at most 1000"),
    ],
)
def test_tool_schemas_are_checked_under_every_tool_choice(parameters, words):
    """Schemas xgrammar cannot use, or that match no text, or over the grammar limits: a 400 naming the tool
    under "auto" too (tool_grammar: the compile workers' part of tool calling)."""
    tools = [TOOLS[1], {"type": "function", "function": {"name": "a", "parameters": parameters}}]
    for choice in (None, "required"):
        with pytest.raises(InvalidRequest, match=words) as e:
            tool_grammar(parse_tools(tools, choice, None).payload(), LIMITS)
        assert e.value.param == "tools[1].function.parameters"


def test_tool_schemas_together_are_under_the_limits():
    many = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"enum": list(range(100))}}} for i in range(11)
    ]
    with pytest.raises(InvalidRequest, match="1100 enum") as e:
        tool_grammar(parse_tools(many, "auto", None).payload(), LIMITS)
    assert e.value.param == "tools" and e.value.code == "grammar_too_complex"
    assert tool_grammar(parse_tools(many[:10], "auto", None).payload(), LIMITS) is None


def test_render_messages_hermes_format():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Paris"}},
                {"name": "get_weather", "arguments": {"city": "Rome"}},
            ],
        },
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "25C"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"name": "ping", "arguments": {}}]},
    ]
    t = setup()
    out = render_messages(messages, t)
    assert out[0] == {"role": "system", "content": "Be brief.\n\n" + t.system_block()}
    assert out[1:] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": call("get_weather", {"city": "Paris"}) + "\n" + call("get_weather", {"city": "Rome"}),
        },
        {"role": "user", "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n</tool_response>"},
        {"role": "assistant", "content": "Checking.\n" + call("ping", {})},
    ]
    block = t.system_block()
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in block and '"name": "ping"' in block
    # no system message: the tools get one; without tools nothing is added
    assert render_messages(messages[1:2], t)[0] == {"role": "system", "content": t.system_block()}
    assert render_messages(messages[1:2], None) == [{"role": "user", "content": "Weather in Paris and Rome?"}]


def accepts(ebnf: str, text: str) -> bool:
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "<eos>"]  # one character per token
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])).compile_grammar(ebnf)
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(vocab.index(ch)) for ch in text) and m.accept_token(len(vocab) - 1)


def test_call_grammar_accepts_only_schema_valid_calls():
    t = setup()
    one = call_grammar(list(t.functions), parallel=False)
    many = call_grammar(list(t.functions), parallel=True)
    paris = call("get_weather", {"city": "Paris", "unit": "root"})  # "root" in a literal survives the rule renaming
    assert accepts(one, paris) and accepts(one, call("ping", {}))
    assert accepts(many, paris + "\n" + call("ping", {})) and not accepts(one, paris + "\n" + call("ping", {}))
    for bad in (
        call("get_weather", {}),
        call("get_weather", {"city": 3}),
        call("get_weather", {"city": "x", "unit": "kelvin"}),
        call("nope", {}),
        paris[:-1],
        "hello",
    ):
        assert not accepts(many, bad), bad
    only_ping = call_grammar([t.functions[1]], parallel=True)
    assert accepts(only_ping, call("ping", {})) and not accepts(only_ping, paris)


def feed_in_pieces(text: str, reader: ToolCallReader, rng: random.Random) -> str:
    out, i = "", 0
    while i < len(text):
        j = i + rng.randint(1, 5)
        out += reader.feed(text[i:j])
        i = j
    return out


@pytest.mark.parametrize(
    "text, content, names",
    [
        ("Just text, no < tool calls here <", "Just text, no < tool calls here <", []),
        ("Let me check.\n" + call("get_weather", {"city": "Paris"}), "Let me check.\n", ["get_weather"]),
        (call("get_weather", {"city": "Paris"}) + "\n" + call("ping", {}) + "\n", None, ["get_weather", "ping"]),
        (f'{OPEN}\n{{"name": "ping", "parameters": {{}}}}\n{CLOSE}', None, ["ping"]),  # "parameters" for "arguments"
        ("x " + call("get_weather", {"city": "Paris"})[:-3], None, []),  # cut off: all content
        (call("unknown", {}), None, []),  # not one of the tools: content
        (f"{OPEN}\n{{not json}}\n{CLOSE}", None, []),
        (call("ping", {}) + " and some prose after", None, []),
        (f'{OPEN}{{"name": "ping", "arguments": [1]}}{CLOSE}', None, []),
    ],
)
def test_reader_splits_content_and_calls_streamed_or_whole(text, content, names):
    t = setup()
    got_content, calls = split_output(text, t)
    assert [c["function"]["name"] for c in calls] == names
    assert got_content == (text if not names else content)
    for c in calls:
        assert (
            c["type"] == "function"
            and c["id"].startswith("call_")
            and isinstance(json.loads(c["function"]["arguments"]), dict)
        )
    rng = random.Random(0)
    for _ in range(20):  # streamed in random pieces: the same split
        reader = t.reader()
        streamed = feed_in_pieces(text, reader, rng)
        rest, stream_calls = reader.finish()
        assert (streamed + rest or None if names else streamed + rest) == got_content
        assert [c["function"] for c in stream_calls] == [c["function"] for c in calls]


def test_reader_passes_content_through_before_a_call():
    reader = setup().reader()
    assert reader.feed("Hello <to") == "Hello "  # "<to" may start <tool_call>: held
    assert reader.feed("day>") == "<today>"
    assert reader.feed(" " + OPEN + '\n{"name": "ping"') == " "
    assert reader.feed(', "arguments": {}}\n' + CLOSE) == ""
    rest, calls = reader.finish()
    assert rest == "" and [c["function"] for c in calls] == [{"name": "ping", "arguments": "{}"}]


def test_parallel_false_returns_one_call():
    text = call("ping", {}) + "\n" + call("get_weather", {"city": "Oslo"})
    assert [c["function"]["name"] for c in split_output(text, setup(parallel=False))[1]] == ["ping"]
    assert len(split_output(text, setup(parallel=True))[1]) == 2
