"""OpenAI request schemas (strict JSON types) and their translation into per-choice Jobs.

Unknown fields are ignored (SDKs send newer ones); known fields we cannot honour (non-function
tools, the deprecated functions API, non-text content, ...) are rejected with a 400 naming the parameter, so a
client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sglang_ext.grammar import JSON_OBJECT, GrammarSpec
from sglang_ext.sampling import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY

from ..api.body import parse  # noqa: F401 - the routes and native.py parse bodies through schemas.parse
from ..api.errors import APIError, invalid
from ..api.tools import assistant_calls, parse_tools, render_messages
from ..backends.base import GenParams, Job

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
# NOTE: the schemas bound token ids to what any vocabulary could hold; the backend that knows the
# vocabulary checks [0, vocab) (an upstream checks its own)
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
MAX_CACHE_SALT_CHARS = 256
# vLLM's cache_salt: requests hit only prefixes cached by requests with the same salt (and API key)
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


@dataclass(frozen=True)
class Limits:
    """Server-side request limits (CLI flags)."""

    max_n: int = 16  # choices per request (n x prompts)
    max_tokens: int = 2048
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request's head, and then its body, must arrive within this (--body-timeout)
    max_connections: int = 1000  # open connections; a new request beyond them gets uvicorn's 503 (--max-connections)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this answers (not shown to the model)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only for completions with echo (score the prompt)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # extensions (SGLang / vLLM names)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    regex: str | None = None  # structured output: the output matches this regex
    ebnf: str | None = None  # ... or this grammar (xgrammar's EBNF)
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(
        None, ge=0
    )  # EOS and stop_token_ids are banned until the output holds this many tokens
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    return_token_ids: bool | None = None  # completion token ids in the last chunk of each choice
    cache_salt: CacheSalt | None = None  # the prefix cache's namespace within the API key's (vLLM)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None  # Predicted Outputs: {"type": "content", "content": text or text parts}
    continue_final_message: bool | None = (
        None  # extension (SGLang/vLLM): the reply continues the last assistant message
    )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None


class TokenizeRequest(_Strict):
    """SGLang's /tokenize (prompt: one text or a list), plus chat messages (and tools) rendered exactly
    as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    continue_final_message: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] | list[list[int]]


MAX_TOKENIZE_PROMPTS = 64


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported by this server", param=param, code="unsupported_parameter")


def _check_common(r: _Common) -> None:
    if r.stream_options is not None and not r.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")


def _stop(r: _Common) -> tuple[str, ...]:
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}", "stop")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise invalid(f"stop: every stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(dict.fromkeys(stop))


def _logit_bias(bias: dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]} -> ((id, bias), ...); ids beyond the vocabulary are
    the backend's to reject (it knows the vocabulary)."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) > MAX_TOKEN_ID:
            got = f"got {key[:24]!r}"
            raise invalid(
                f"logit_bias: keys must be token ids (integers from 0 to {MAX_TOKEN_ID}), {got}", "logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid(
                f"logit_bias: values must be numbers from -100 to 100, got {value!r} for token {key}", "logit_bias"
            )
        out.append((int(key), float(value)))
    if len({t for t, _ in out}) < len(out):
        raise invalid("logit_bias names a token more than once", "logit_bias")
    return tuple(out)


def _grammar(r: _Common) -> GrammarSpec | None:
    """response_format (json_object, json_schema; chat) or the SGLang extensions regex / ebnf: at most one."""
    fmt = getattr(r, "response_format", None) or {"type": "text"}
    kind = fmt.get("type")
    asked = [
        name
        for name, on in (
            ("response_format", kind != "text"),
            ("regex", r.regex is not None),
            ("ebnf", r.ebnf is not None),
        )
        if on
    ]
    if len(asked) > 1:
        raise invalid(f"{' and '.join(asked)} cannot be combined: give one output constraint", asked[1])
    for param, source in (("regex", r.regex), ("ebnf", r.ebnf)):
        if source is not None:
            if not source:
                raise invalid(f"{param} must not be empty", param)
            return GrammarSpec(param, source)
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise _unsupported("response_format", f"response_format {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise invalid("response_format: json_schema.schema must be a JSON schema object", "response_format")
    return GrammarSpec("json_schema", json.dumps(spec["schema"]))


def _logprobs(k: int | None, param: str) -> int | None:
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise invalid(f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", param)
    return k


def _params(
    r: _Common, max_tokens: int | None, max_tokens_param: str, limits: Limits, logprobs: int | None = None
) -> GenParams:
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise invalid(
            f"{max_tokens_param}: at most {limits.max_tokens} tokens per request, got {max_tokens}", max_tokens_param
        )
    if r.min_tokens and max_tokens is not None and r.min_tokens > max_tokens:
        raise invalid(f"min_tokens ({r.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})", "min_tokens")
    if r.min_tokens and r.min_tokens > limits.max_tokens:
        limit = f"this server's max_tokens limit ({limits.max_tokens})"
        raise invalid(f"min_tokens ({r.min_tokens}) must not exceed {limit}", "min_tokens")
    n = r.n or 1
    if r.seed is not None and r.seed + n - 1 > MAX_SEED:
        raise invalid(f"seed: seed + n - 1 must be <= {MAX_SEED}", "seed")
    return GenParams(
        max_tokens=max_tokens,
        temperature=1.0 if r.temperature is None else float(r.temperature),
        top_p=1.0 if r.top_p is None else float(r.top_p),
        top_k=max(r.top_k or 0, 0),
        seed=r.seed,
        stop=_stop(r),
        stop_token_ids=tuple(r.stop_token_ids or ()),
        ignore_eos=bool(r.ignore_eos),
        min_tokens=r.min_tokens or 0,
        logprobs=logprobs,
        presence_penalty=float(r.presence_penalty or 0.0),
        frequency_penalty=float(r.frequency_penalty or 0.0),
        repetition_penalty=1.0 if r.repetition_penalty is None else float(r.repetition_penalty),
        logit_bias=_logit_bias(r.logit_bias),
        grammar=_grammar(r),
    )


def _fan_out(r: _Common, params: GenParams, prompts: list[dict], limits: Limits) -> list[Job]:
    """n choices per prompt; with a seed, choice i gets seed + i (independent but reproducible)."""
    n = r.n or 1
    if n * len(prompts) > limits.max_n:
        param = "n" if len(prompts) == 1 else "prompt"
        raise invalid(
            f"{param}: at most {limits.max_n} choices per request (n x prompts), got {n * len(prompts)}", param
        )
    jobs = []
    for g, prompt in enumerate(prompts):
        for i in range(n):
            index = g * n + i
            seeded = params if params.seed is None else replace(params, seed=params.seed + i)
            jobs.append(Job(index=index, params=seeded, prompt_group=g, **prompt))
    return jobs


def _message_text(m: ChatMessage, i: int) -> str:
    if isinstance(m.content, str):
        return m.content
    if m.content is None:
        raise invalid(f"messages[{i}].content is required", f"messages[{i}].content")
    parts = []
    for j, p in enumerate(m.content):
        if p.type != "text" or p.text is None:
            raise _unsupported(f"messages[{i}].content[{j}]", f"content of type {p.type!r} (only text)")
        parts.append(p.text)
    return "".join(parts)


def _prediction(prediction: dict[str, Any] | None) -> str:
    """OpenAI's `prediction` ({"type": "content", "content": str | [{"type": "text", "text"}]}) -> its text."""
    if prediction is None:
        return ""
    if prediction.get("type") != "content":
        raise invalid('prediction must be {"type": "content", "content": ...}', "prediction")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid("prediction.content must be a string or a list of text parts", "prediction")


def _message(m: ChatMessage, i: int) -> dict:
    if m.role == "function":
        raise _unsupported(f"messages[{i}].role", "role 'function' (the deprecated functions API; use tools)")
    if m.tool_calls is not None and m.role != "assistant":
        raise invalid(
            f"messages[{i}].tool_calls: only assistant messages carry tool calls", f"messages[{i}].tool_calls"
        )
    if m.role == "assistant" and m.tool_calls:
        content = "" if m.content is None else _message_text(m, i)
        return {"role": "assistant", "content": content, "tool_calls": assistant_calls(m.tool_calls, i)}
    return {"role": "system" if m.role == "developer" else m.role, "content": _message_text(m, i)}


def chat_jobs(r: ChatCompletionRequest, limits: Limits) -> list[Job]:
    _check_common(r)
    if r.top_logprobs is not None and not r.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = _logprobs(r.top_logprobs or 0, "top_logprobs") if r.logprobs else None
    if r.functions or r.function_call not in (None, "none"):
        raise _unsupported("functions", "the deprecated functions API (use tools)")
    tools = parse_tools(r.tools, r.tool_choice, r.parallel_tool_calls)
    if not r.messages:
        raise invalid("messages must contain at least one message", "messages")
    messages = render_messages([_message(m, i) for i, m in enumerate(r.messages)], tools)
    if r.continue_final_message and (r.messages[-1].role != "assistant" or r.messages[-1].tool_calls):
        raise invalid(
            "continue_final_message needs the last message to be an assistant message with text (the start of the "
            "reply)",
            "messages",
        )
    if r.max_tokens == 0:
        raise invalid("max_tokens must be at least 1", "max_tokens")
    max_tokens: int | None
    if r.max_completion_tokens is not None:
        max_tokens, param = r.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = r.max_tokens, "max_tokens"
    params = replace(_params(r, max_tokens, param, limits, logprobs), prediction=_prediction(r.prediction))
    if tools is not None and tools.choice != "auto" and params.grammar is not None:
        raise invalid(
            "a required tool call constrains the output already: tool_choice cannot be combined with "
            f"{params.grammar.param}",
            "tool_choice",
        )
    return _fan_out(
        r,
        params,
        [{"messages": tuple(messages), "tools": tools, "continue_final": bool(r.continue_final_message)}],
        limits,
    )


def tokenize_jobs(r: TokenizeRequest) -> tuple[list[Job], bool]:
    """(one Job per text or the chat, whether the answer is a list)."""
    if (r.prompt is None) == (r.messages is None):
        raise invalid("give either prompt or messages", "prompt")
    if r.messages is not None:
        if not r.messages:
            raise invalid("messages must contain at least one message", "messages")
        tools = parse_tools(r.tools, r.tool_choice, None)
        messages = tuple(render_messages([_message(m, i) for i, m in enumerate(r.messages)], tools))
        return [Job(0, messages=messages, continue_final=bool(r.continue_final_message))], False
    texts = [r.prompt] if isinstance(r.prompt, str) else list(r.prompt or ())
    if not 1 <= len(texts) <= MAX_TOKENIZE_PROMPTS:
        raise invalid(f"prompt: 1 to {MAX_TOKENIZE_PROMPTS} texts, got {len(texts)}", "prompt")
    return [Job(i, prompt=t) for i, t in enumerate(texts)], not isinstance(r.prompt, str)


def completion_jobs(r: CompletionRequest, limits: Limits) -> list[Job]:
    _check_common(r)
    for param, value, default in (("suffix", r.suffix, None), ("best_of", r.best_of, 1)):
        if value not in (None, default) and not (param == "suffix" and value == ""):
            raise _unsupported(param, param)
    p = r.prompt
    prompts: list[str | tuple[int, ...]]
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [tuple(x for x in p if isinstance(x, int))]
    else:
        prompts = [x if isinstance(x, str) else tuple(x) for x in p if not isinstance(x, int)]
    if not prompts or any(len(x) == 0 for x in prompts):
        raise invalid("prompt must not be empty", "prompt")
    if any(not 0 <= t <= MAX_TOKEN_ID for x in prompts if not isinstance(x, str) for t in x):
        raise invalid(
            f"prompt token ids must be integers from 0 to {MAX_TOKEN_ID} (below the vocabulary size)", "prompt"
        )
    if r.max_tokens == 0 and not r.echo:
        raise invalid("max_tokens 0 is only allowed with echo (to score the prompt)", "max_tokens")
    params = replace(
        _params(r, r.max_tokens, "max_tokens", limits, _logprobs(r.logprobs, "logprobs")), echo=bool(r.echo)
    )
    return _fan_out(r, params, [{"prompt": x} for x in prompts], limits)
