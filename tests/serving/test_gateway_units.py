"""Gateway pieces without a server: incremental detokenization + stop strings, request -> jobs,
API keys, error params."""

import time

import pytest
from helpers import slots_whole

from serving.api.errors import APIError, _param
from serving.api.tools import tool_grammar
from serving.backends.detok import IncrementalText
from serving.gateway.auth import APIKeys
from serving.gateway.schemas import ChatCompletionRequest, CompletionRequest, Limits, chat_jobs, completion_jobs, parse
from serving.gateway.settings import reload_gateway_settings
from sglang_ext.grammar import GrammarLimits


def chars(ids):
    return "".join(chr(i) for i in ids)


def feed(text: IncrementalText, s: str, step: int = 1):
    """Push the characters of s `step` at a time; return the emitted pieces and whether a stop was hit."""
    pieces = []
    for i in range(0, len(s), step):
        out, stopped = text.push([ord(c) for c in s[i : i + step]])
        pieces.append(out)
        if stopped:
            return pieces, True
    pieces.append(text.push([], final=True)[0])
    return pieces, False


@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_stop_string_is_excluded_and_never_partially_emitted(step):
    pieces, stopped = feed(IncrementalText(chars, ["###", "STOP"]), "ab #c ## d ###tail", step)
    assert stopped and "".join(pieces) == "ab #c ## d "
    # emitted text is never taken back, so an exact total proves no part of the final "###" went out


def test_held_back_prefix_is_released_when_it_cannot_be_a_stop():
    t = IncrementalText(chars, ["STOP"])
    assert t.push([ord(c) for c in "go ST"]) == ("go ", False)
    assert t.push([ord("A")]) == ("STA", False)  # "STA" is no prefix of "STOP": released
    assert t.push([ord("S"), ord("T"), ord("O")]) == ("", False)
    assert t.push([ord("P"), ord("x")]) == ("", True)
    assert t.push([], final=True)[0] == ""


def test_earliest_of_several_stop_strings_wins():
    t = IncrementalText(chars, ["world", "lo w"])
    out, stopped = t.push([ord(c) for c in "hello world"])
    assert stopped and out == "hel"


def test_multibyte_tokens_never_emit_replacement_chars(smollm2_fp32):
    tok = smollm2_fp32
    s = "Snowman ☃, rocket 🚀, 中文字符 and naïve café — done."
    ids = tok.encode(s)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "test needs a character split over several tokens"
    t = IncrementalText(tok.decode)
    pieces = [t.push([i])[0] for i in ids] + [t.push([], final=True)[0]]
    assert "".join(pieces) == tok.decode(ids) == s
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_inside_multibyte_run(smollm2_fp32):
    tok = smollm2_fp32
    s = "abc 🚀🚀 def"
    t = IncrementalText(tok.decode, ["🚀"])
    pieces = []
    for i in tok.encode(s):
        out, stopped = t.push([i])
        pieces.append(out)
        if stopped:
            break
    assert stopped and "".join(pieces) == "abc "


def _chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    import json

    return parse(ChatCompletionRequest, json.dumps(body).encode())


def test_chat_jobs_n_seed_and_params():
    jobs = chat_jobs(_chat(n=3, seed=5, temperature=0.7, stop="x", max_tokens=9, max_completion_tokens=7), Limits())
    assert [j.index for j in jobs] == [0, 1, 2]
    assert [j.params.seed for j in jobs] == [5, 6, 7]
    assert all(j.params.max_tokens == 7 and j.params.stop == ("x",) and j.params.temperature == 0.7 for j in jobs)
    assert jobs[0].messages == ({"role": "user", "content": "hi"},)
    # developer -> system, text parts joined
    j = chat_jobs(
        _chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        ),
        Limits(),
    )[0]
    assert j.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"})
    assert j.params.temperature == 1.0 and j.params.seed is None  # OpenAI defaults


def test_chat_jobs_with_tools():
    """Tools reach the job as its reader's set-up (the backend's compile workers turn a required call into
    its grammar: tool_grammar); the messages are rendered (tool results as user turns)."""
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        }
    ]
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "2"},
    ]
    auto = chat_jobs(_chat(messages=history, tools=tools, n=2), Limits())
    assert [j.tools.choice for j in auto] == ["auto", "auto"] and auto[0].params.grammar is None
    assert [m["role"] for m in auto[0].messages] == ["system", "user", "assistant", "user"]
    assert auto[0].messages[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    required = chat_jobs(_chat(tools=tools, tool_choice="required"), Limits())[0]
    assert required.tools.choice == "required" and required.params.grammar is None
    call = tool_grammar(required.tools.payload(), GrammarLimits())
    assert (call.kind, call.param) == ("ebnf", "tools") and "call_json" in call.source
    assert tool_grammar(auto[0].tools.payload(), GrammarLimits()) is None
    none = chat_jobs(_chat(messages=history, tools=tools, tool_choice="none"), Limits())[0]
    assert none.tools is None and none.messages[0]["role"] == "user"  # no tools block; the history still rendered


def test_prediction_text_and_usage():
    from serving.backends.embedded import prediction_usage

    assert chat_jobs(_chat(prediction={"type": "content", "content": "ab"}), Limits())[0].params.prediction == "ab"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_jobs(_chat(prediction={"type": "content", "content": parts}), Limits())[0].params.prediction == "ab"
    assert chat_jobs(_chat(), Limits())[0].params.prediction == ""
    # prediction 1 2 3 4 5 against output 1 2 9 4 5 6: 1 2 and 4 5 appear in order -> 4 accepted, 1 rejected
    assert prediction_usage((1, 2, 3, 4, 5), [1, 2, 9, 4, 5, 6]) == (4, 1)
    assert prediction_usage((7, 8), [1, 2]) == (0, 2)


def test_completion_jobs_prompt_lists():
    import json

    r = parse(CompletionRequest, json.dumps({"prompt": ["a", "b"], "n": 2}).encode())
    jobs = completion_jobs(r, Limits())
    assert [(j.index, j.prompt_group, j.prompt) for j in jobs] == [(0, 0, "a"), (1, 0, "a"), (2, 1, "b"), (3, 1, "b")]
    r = parse(CompletionRequest, json.dumps({"prompt": [1, 2, 3]}).encode())
    assert completion_jobs(r, Limits())[0].prompt == (1, 2, 3)
    with pytest.raises(APIError) as e:
        completion_jobs(parse(CompletionRequest, json.dumps({"prompt": ["a"] * 5, "n": 4}).encode()), Limits(max_n=16))
    assert e.value.status == 400 and e.value.param == "prompt"


def test_validation_error_param_names():
    assert _param(("messages", 0, "content", "str")) == "messages[0].content"
    assert _param(("stop", "list[str]", 2)) == "stop[2]"
    with pytest.raises(APIError) as e:
        _chat(messages=[{"role": "user", "content": 5}])
    assert e.value.param == "messages[0].content" and e.value.status == 400
    with pytest.raises(APIError) as e:
        parse(ChatCompletionRequest, b'{"model": "m"}')
    assert e.value.param == "messages" and e.value.code == "missing_required_parameter"


def test_api_keys_env_file_and_reload(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# comment\nfile-key-1\n\n  file-key-2  \n")
    monkeypatch.setenv("MOA_SERVE_API_KEYS", "env-a, env-b")
    reload_gateway_settings()
    keys = APIKeys.from_env(str(f))
    assert keys.enabled
    for k in ("env-a", "env-b", "file-key-1", "file-key-2"):
        assert keys.check(f"Bearer {k}")
    for bad in (None, "", "Bearer", "Bearer nope", "Basic file-key-1", "file-key-1", "Bearer file-key-1x"):
        assert not keys.check(bad)
    f.write_text("rotated\n")
    import os

    os.utime(f, (time.time() + 5, time.time() + 5))
    monkeypatch.setattr("serving.gateway.auth.RELOAD_CHECK_S", 0.0)
    assert keys.check("Bearer rotated") and not keys.check("Bearer file-key-1")
    monkeypatch.delenv("MOA_SERVE_API_KEYS")
    monkeypatch.delenv("MOA_SERVE_API_KEYS_FILE", raising=False)
    reload_gateway_settings()
    assert not APIKeys.from_env().enabled
    with pytest.raises(FileNotFoundError):
        APIKeys(file=tmp_path / "missing")


def test_engine_loop_admits_by_kv_reservation_and_delivers_everything():
    """Only as many requests run as their worst-case KV fits; the rest wait; all finish; no slot leaks."""
    import asyncio

    from helpers import tiny_target

    from serving.config import EngineConfig
    from serving.engine import Engine
    from serving.engine_loop import EngineLoop, QueueFull
    from sglang_ext.drafters import NgramDrafter
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    tree = TreeShape(3, 2, 6)
    per_request = 10 + 20 + tree.num_draft_tokens + 1  # prompt + max_new + one tree
    engine = Engine(tiny_target(), NgramDrafter(), EngineConfig(tree=tree, kv_slots=1 + 2 * per_request + 5))
    real_step, peak = engine.step, []

    def step():
        peak.append(len(engine.running) + len(engine.waiting))
        return real_step()

    engine.step = step
    engine_loop = EngineLoop(engine, max_running=8, max_queue=0)
    engine_loop.start()

    async def run():
        params = SamplingParams(max_new_tokens=20, ignore_eos=True)
        handles = [engine_loop.submit([i % 8] * 10, params) for i in range(4)]
        with pytest.raises(QueueFull):  # max_queue=0: only free running slots (8) may be pending or active
            for _ in range(5):
                engine_loop.submit([1] * 10, params)
        outs = []
        for h in handles:
            toks = []
            while True:
                d = await h.next()
                toks += d.tokens
                if d.finish_reason or d.error:
                    outs.append((len(toks), d.finish_reason))
                    break
        return outs

    try:
        outs = asyncio.run(run())
    finally:
        engine_loop.abort_all()
        engine_loop.stop()
    assert outs[:4] == [(20, "length")] * 4
    assert max(peak) == 2
    assert slots_whole(engine)


def test_a_newcomer_tenants_first_token_comes_from_a_step_of_its_own():
    """Through the engine loop: tenant b arrives while tenant a's requests decode; b's prompt is prefilled in a step
    without a's trees (its owner's name reaches the scheduler), a's next step follows at once, and a request of a
    tenant already running rides in a's forward."""
    import asyncio

    from helpers import tiny_target

    from serving.config import EngineConfig
    from serving.engine import Engine
    from serving.engine_loop import EngineLoop
    from serving.tenancy import Tenant
    from sglang_ext.sampling import SamplingParams

    engine = Engine(tiny_target(), None, EngineConfig(kv_slots=1024))
    real_step, steps, late = engine.step, [], []
    a, b = Tenant("a"), Tenant("b")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    def step():
        events = real_step()
        steps.append([(e.request.share, len(e.request.output_ids) == len(e.new_tokens)) for e in events])
        if len(steps) == 3:  # (submitted from the engine thread between steps: a's requests are surely running)
            late.append(engine_loop.submit([5] * 5, params, asyncio_loop, owner=b))
            late.append(engine_loop.submit([6] * 7, params, asyncio_loop, owner=a))
        return events

    engine.step = step
    engine_loop = EngineLoop(engine, max_running=8, max_queue=8)
    engine_loop.start()
    asyncio_loop = None

    async def drain(h):
        while not ((d := await h.next()).finish_reason or d.error):
            pass
        assert d.finish_reason == "length", d.error

    async def run():
        nonlocal asyncio_loop
        asyncio_loop = asyncio.get_running_loop()
        first = [engine_loop.submit([3 + i] * 6, params, owner=a) for i in range(2)]
        for h in first:
            await drain(h)
        for h in late:
            await drain(h)

    try:
        asyncio.run(run())
    finally:
        engine_loop.abort_all()
        engine_loop.stop()
    assert len(late) == 2
    b_first = next(i for i, s in enumerate(steps) if ("b", True) in s)
    assert steps[b_first] == [("b", True)]  # b's prompt alone: a's two requests waited this one step
    assert ("a", False) in steps[b_first + 1]  # and decoded in the next
    a_late = next(i for i, s in enumerate(steps) if i > 0 and ("a", True) in s)
    assert ("a", False) in steps[a_late]  # a's late request: prefilled beside a's running trees
    assert slots_whole(engine)


def _serve_args(*flags: str):
    from moa_serve.entrypoints.cli import build_parser

    return build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize(
    "flags,env,message",
    [
        (["--backend", "sglang"], {}, "--backend sglang needs --upstream URL"),
        (["--backend", "sglang", "--upstream", "ftp://x"], {}, "--upstream must be an http\\(s\\) URL"),
        (
            ["--edge-drafters", "eagle3"],
            {"MOA_SERVE_BACKEND": "sglang", "MOA_SERVE_UPSTREAM": "http://u:1"},
            "embedded",
        ),
        (["--tree", "0,1,1"], {}, "tree"),
        (["--prefix-cache-tokens", "-1"], {}, "prefix_cache_tokens"),
    ],
    ids=["no-upstream", "bad-upstream", "edge-upstream", "bad-tree", "bad-prefix-cache-size"],
)
def test_serve_options_refuse_a_bad_combination_before_any_model_loads(monkeypatch, flags, env, message):
    """The serve flags become one ServeOptions (moa_serve/entrypoints/serve.py), the only place the backend is chosen;
    each refusal is a ValueError (the CLI's one-line error) raised before build_gateway loads anything."""
    from moa_serve.entrypoints.serve import serve_options

    for var in ("MOA_SERVE_BACKEND", "MOA_SERVE_UPSTREAM"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reload_gateway_settings()
    with pytest.raises(ValueError, match=message):
        serve_options(_serve_args(*flags))


def test_serve_options_pick_the_backend_from_flag_then_environment(monkeypatch):
    from moa_serve.entrypoints.serve import serve_options

    monkeypatch.setenv("MOA_SERVE_BACKEND", "sglang")
    monkeypatch.setenv("MOA_SERVE_UPSTREAM", "http://sglang:30000")
    reload_gateway_settings()
    o = serve_options(_serve_args())
    assert o.backend == "sglang" and o.upstream.url == "http://sglang:30000" and o.drafter_label == "upstream"
    o = serve_options(_serve_args("--backend", "embedded", "--drafter", "ngram", "--kv-slots", "4096"))
    assert o.backend == "embedded" and o.engine.drafter == "ngram" and o.engine.kv_slots == 4096 and o.upstream is None
    assert o.engine.prefix_cache and o.engine.prefix_cache_tokens is None  # the prefix cache is on by default
    o = serve_options(_serve_args("--backend", "embedded", "--no-prefix-cache", "--prefix-cache-tokens", "2048"))
    assert not o.engine.prefix_cache and o.engine.prefix_cache_tokens == 2048
    assert o.engine.prefill == "first"  # a newcomer tenant's prompt in a step of its own
    assert serve_options(_serve_args("--backend", "embedded", "--prefill", "mixed")).engine.prefill == "mixed"
    with pytest.raises(SystemExit):  # the flag's choices are settings.BACKENDS
        _serve_args("--backend", "vllm")
