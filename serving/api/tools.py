"""Tool calling (chat `tools`, `tool_choice`) for any chat model, the same on every backend.

The gateway itself renders tools into the prompt and reads calls out of the text, in the Hermes
format (the one Qwen2.5, Hermes and SmolLM2's function-calling data use); the backend only sees plain
chat messages and, when a call is required, a grammar:

    tools                    ──► a system-prompt block listing the functions as JSON
    assistant.tool_calls     ──► <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    role "tool" messages     ──► one user turn of <tool_response>\\n...\\n</tool_response> blocks
    tool_choice required/{function} ──► EBNF: one (or, with parallel_tool_calls, more) such blocks whose
                                         arguments match the function's JSON schema (xgrammar)
    output text              ──► content before the first <tool_call>, and the calls; finish_reason "tool_calls"

parse_tools checks the request's shape on the event loop; `tool_grammar` (xgrammar work: every schema
converted, and the call grammar built) runs where all grammar work runs, in a compile worker
(serving/backends/grammar_pool.py), under the grammar limits and the compile budget.

A reply whose <tool_call> blocks do not all parse as calls of the given functions is returned whole
as content: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from sglang_ext.grammar import GrammarLimits, GrammarSpec, check_limits, parse_grammar

from .body import JSONError, load_field, load_json
from .errors import APIError, invalid

MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# EBNF lexemes: a string literal, a character class, an identifier, any other character
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict  # JSON schema of the arguments object

    def as_tool(self) -> dict:
        f: dict = {"name": self.name, "parameters": self.parameters}
        if self.description:
            f["description"] = self.description
        return {"type": "function", "function": f}


@dataclass(frozen=True)
class ToolCalling:
    """One chat request's tools: how its prompt is written and its output read."""

    functions: tuple[Function, ...]
    choice: str  # "auto", "required", or the name of the function that must be called
    parallel: bool  # more than one call per reply

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def system_block(self) -> str:
        tools = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in self.functions)
        return (
            "# Tools\n\nYou may call one or more of these functions to answer the user. Their signatures, "
            f"one JSON object per line, are inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
            "To call a function, reply with a JSON object holding its name and arguments inside "
            "<tool_call></tool_call>:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
        )

    def payload(self) -> dict:
        """What tool_grammar needs, as JSON values (sent to a compile worker, and its cache key)."""
        functions = [{"name": f.name, "parameters": f.parameters} for f in self.functions]
        return {"functions": functions, "choice": self.choice, "parallel": self.parallel}

    def reader(self) -> ToolCallReader:
        return ToolCallReader(self.names, self.parallel)


def parse_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolCalling | None:
    """The request's tool set-up, or None when the reply is plain text (no tools, or tool_choice "none")."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise invalid(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise invalid("tools: function names must be unique", "tools")
    choice = _choice(tool_choice, set(names))
    return (
        None
        if choice == "none"
        else ToolCalling(functions, choice, True if parallel_tool_calls is None else parallel_tool_calls)
    )


def _function(tool: Any, i: int) -> Function:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(
            400, f"{param}: only tools of type 'function' are supported", param=param, code="unsupported_parameter"
        )
    f = tool.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
        raise invalid(f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'", f"{param}.function.name")
    description = f.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{param}.function.description must be a string", f"{param}.function.description")
    parameters = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise invalid(f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters")
    return Function(f["name"], description, parameters)


def tool_grammar(payload: dict, limits: GrammarLimits) -> GrammarSpec | None:
    """Every function's schema checked (the grammar limits, each alone and all together, and xgrammar can
    convert it); the call grammar when a call is required (None for "auto"). payload: ToolCalling.payload().
    Grammar work: this runs in a compile worker."""
    functions = [Function(f["name"], None, f["parameters"]) for f in payload["functions"]]
    schemas = [
        GrammarSpec("json_schema", json.dumps(f.parameters), f"tools[{i}].function.parameters")
        for i, f in enumerate(functions)
    ]
    for spec in schemas:  # the limits first, each tool's then all together (cheap), then the conversions
        check_limits(spec, limits)
    check_limits(GrammarSpec("json_schema", json.dumps([f.parameters for f in functions]), "tools"), limits)
    for spec in schemas:
        parse_grammar(spec, None)
    if payload["choice"] == "auto":
        return None
    chosen = [f for f in functions if payload["choice"] in ("required", f.name)]
    return GrammarSpec("ebnf", call_grammar(chosen, payload["parallel"]), "tools")


def _choice(tool_choice: Any, names: set[str]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    if (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
    ):
        name = tool_choice["function"].get("name")
        if name in names:
            return name
        raise invalid(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    raise invalid(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def call_grammar(functions: list[Function], parallel: bool) -> str:
    """EBNF for <tool_call> blocks calling one of `functions` with schema-valid arguments."""
    import xgrammar as xgr

    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    # NOTE: compact separators: the any-whitespace JSON grammar lets a small model pad forever
    json_rules = str(xgr.Grammar.from_json_schema(json.dumps(call), any_whitespace=False))
    json_rules = "".join("call_json" if tok == "root" else tok for tok in _EBNF_TOKEN.findall(json_rules))
    repeat = ' ("\\n" call)*' if parallel else ""
    return (
        f"{json_rules}\nroot ::= call{repeat}\n"
        f'call ::= "{_ebnf_literal(OPEN)}\\n" call_json "\\n{_ebnf_literal(CLOSE)}"\n'
    )


def _ebnf_literal(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# --- prompt ---------------------------------------------------------------------------------------
def render_messages(messages: list[dict], tools: ToolCalling | None) -> list[dict]:
    """OpenAI chat messages (roles system/user/assistant/tool, assistant tool_calls) -> plain
    {"role", "content"} messages any chat template renders."""
    out: list[dict] = []
    for k, m in enumerate(messages):
        if m["role"] == "tool":  # consecutive tool results: one user turn
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if k and messages[k - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{m['content']}\n{calls}" if m.get("content") else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tools.system_block()}"}
        else:
            out.insert(0, {"role": "system", "content": tools.system_block()})
    return out


def assistant_calls(calls: list[Any], i: int) -> list[dict]:
    """An input assistant message's tool_calls -> [{"name", "arguments": object}] (as the model wrote them)."""
    out = []
    for j, c in enumerate(calls):
        param = f"messages[{i}].tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise invalid(
                f"{param} must be {{'id', 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}", param
            )
        arguments = load_field(f["arguments"], f"{param}.function.arguments", "it must be a JSON object (as text)")
        out.append({"name": f["name"], "arguments": arguments})
    return out


# --- output ---------------------------------------------------------------------------------------
class ToolCallReader:
    """Splits one choice's text, fed as it streams, into content and tool calls.

    Text before the first <tool_call> is content and passes through at once (less a tail that may be
    the start of <tool_call>); from <tool_call> on it is held until the end, then parsed."""

    def __init__(self, names: frozenset[str], parallel: bool):
        self.names, self.parallel = names, parallel
        self.held = ""
        self.in_calls = False

    def feed(self, text: str) -> str:
        """The part of `text` that is content for sure."""
        if self.in_calls:
            self.held += text
            return ""
        s = self.held + text
        at = s.find(OPEN)
        if at >= 0:
            self.in_calls, self.held = True, s[at:]
            return s[:at]
        keep = next((k for k in range(min(len(OPEN) - 1, len(s)), 0, -1) if OPEN.startswith(s[-k:])), 0)
        self.held = s[len(s) - keep :]
        return s[: len(s) - keep]

    def finish(self) -> tuple[str, list[dict]]:
        """(the rest of the content, the calls); when the held text is not well-formed calls, it is content."""
        calls = self._calls(self.held) if self.in_calls else None
        return (self.held, []) if calls is None else ("", calls)

    def _calls(self, text: str) -> list[dict] | None:
        if _BLOCK.sub("", text).strip():
            return None  # text outside complete blocks (a cut-off call, prose after the calls)
        calls = []
        for body in _BLOCK.findall(text):
            try:
                call = load_json(body, "a tool call")
            except JSONError:  # (deep nesting included: a model's output is bounded by max_tokens only)
                return None
            if not isinstance(call, dict) or call.get("name") not in self.names:
                return None
            arguments = call.get("arguments", call.get("parameters", {}))
            if not isinstance(arguments, dict):
                return None
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
            )
        # NOTE: parallel_tool_calls=false promises at most one call; a model that wrote more gets its first
        return calls if self.parallel else calls[:1]


def split_output(text: str, tools: ToolCalling) -> tuple[str | None, list[dict]]:
    """A whole reply -> (content, calls), exactly as a stream of it is split."""
    reader = tools.reader()
    content = reader.feed(text)
    rest, calls = reader.finish()
    content += rest
    return (content or None) if calls else content, calls
