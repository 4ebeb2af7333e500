"""The grammar compile workers (serving/grammar_pool.py): real worker processes, the SmolLM2 vocabulary.

Compiled grammars and refusals come from the cache without a worker; the n choices of a request share one
compile; a compile past its budget, or whose every client left, has its worker process killed; too many
waiters get a 429; a worker that dies is a server fault."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
import xgrammar as xgr

from serving.api.errors import APIError
from serving.api.tools import parse_tools
from serving.grammar_pool import GrammarConfig, GrammarFault, GrammarPool
from sglang_ext.grammar import JSON_OBJECT, GrammarLimits, Grammars, GrammarSpec
from sglang_ext.models.loader import load_tokenizer, resolve_target

EOS = 2
WIDE = GrammarLimits(max_chars=10**7, max_nodes=10**7, max_enum=10**7)  # lets a slow grammar reach the compiler
# ~14 s to compile on the 2-core CI machine (xgrammar's string enums grow steeply past ~8,000 values)
SLOW = GrammarSpec("json_schema", json.dumps({"enum": [f"value{i}" for i in range(25_000)]}))
TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
]


@pytest.fixture(scope="module")
def grammars():
    return Grammars(load_tokenizer(resolve_target("smollm2")), 49152, [EOS])


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def workers(pool: GrammarPool) -> list:
    return [*pool._idle, *pool._busy]


async def busy(pool: GrammarPool) -> None:
    """Until a worker holds a job."""
    while not pool._busy:
        await asyncio.sleep(0.01)


async def reaped(pool: GrammarPool) -> None:
    await asyncio.gather(*pool._ending)


def accepts(compiled, text: str, tokenizer) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.accept_token(EOS)


def test_compiled_grammars_and_refusals_come_from_the_cache(grammars):
    async def main():
        results: list[str] = []
        pool = GrammarPool(grammars, GrammarConfig(workers=1), results.append)
        try:
            ready = await pool.prepare(JSON_OBJECT, None)
            assert ready.spec == JSON_OBJECT and accepts(ready.compiled, '{"a": 1}', grammars._tokenizer)
            assert not accepts(ready.compiled, "[1]", grammars._tokenizer)
            with pytest.raises(APIError) as e:
                await pool.prepare(GrammarSpec("ebnf", "root ::= root"), None)
            assert (e.value.status, e.value.param) == (400, "ebnf") and "matches no text" in e.value.message
            assert await pool.prepare(None, None) is None
            await pool.close()  # no worker left: what follows comes from the cache
            assert workers(pool) == []
            assert (await pool.prepare(JSON_OBJECT, None)).compiled is ready.compiled
            with pytest.raises(APIError, match="matches no text"):
                await pool.prepare(GrammarSpec("ebnf", "root ::= root"), None)
            assert workers(pool) == []
            assert results == ["compiled", "refused", "cached", "cached"]
        finally:
            await pool.close()

    run(main())


def test_the_choices_of_a_request_share_one_compile_and_tools_become_the_call_grammar(grammars):
    async def main():
        pool = GrammarPool(grammars, GrammarConfig(workers=2))
        try:
            tools = parse_tools(TOOLS, "required", False)
            outs = await asyncio.gather(*(pool.prepare(None, tools) for _ in range(4)))
            assert len(workers(pool)) == 1  # one job: a second worker was never needed
            assert all(o.compiled is outs[0].compiled for o in outs)
            spec = outs[0].spec
            assert (spec.kind, spec.param) == ("ebnf", "tools") and "call_json" in spec.source
            call = '<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>'
            assert accepts(outs[0].compiled, call, grammars._tokenizer)
            assert not accepts(outs[0].compiled, call.replace("3", '"x"'), grammars._tokenizer)
            auto = await pool.prepare(None, parse_tools(TOOLS, "auto", None))
            assert auto.spec is None and auto.compiled is None  # checked, nothing to constrain
        finally:
            await pool.close()

    run(main())


def test_a_compile_past_its_budget_is_stopped_and_the_pool_serves_on(grammars):
    async def main():
        results: list[str] = []
        pool = GrammarPool(grammars, GrammarConfig(workers=1, timeout_s=0.5, limits=WIDE), results.append)
        try:
            await pool.prepare(JSON_OBJECT, None)  # a started worker: the budget does not include its start
            (worker,) = workers(pool)
            with pytest.raises(APIError) as e:
                await pool.prepare(SLOW, None)
            assert (e.value.status, e.value.code, e.value.param) == (400, "grammar_too_complex", "response_format")
            assert "compile budget of 0.5 s" in e.value.message
            await reaped(pool)
            assert worker.proc.returncode == -signal.SIGKILL
            assert (await pool.prepare(GrammarSpec("regex", "[a-z]+"), None)).compiled is not None
            assert results == ["compiled", "timeout", "compiled"]
        finally:
            await pool.close()

    run(main())


def test_a_compile_nobody_waits_for_is_stopped(grammars):
    async def main():
        results: list[str] = []
        pool = GrammarPool(grammars, GrammarConfig(workers=1, timeout_s=300, limits=WIDE), results.append)
        try:
            waiters = [asyncio.ensure_future(pool.prepare(SLOW, None)) for _ in range(2)]
            await busy(pool)
            (worker,) = workers(pool)
            waiters[0].cancel()  # one client left: the other still waits, the compile goes on
            await asyncio.sleep(0.2)
            assert worker.alive and not waiters[1].done()
            waiters[1].cancel()  # the last one left
            await asyncio.gather(*waiters, return_exceptions=True)
            while not pool._ending and worker.alive:
                await asyncio.sleep(0.01)
            await reaped(pool)
            assert worker.proc.returncode == -signal.SIGKILL
            assert not pool._flights and results == ["cancelled"]
        finally:
            await pool.close()

    run(main())


def test_too_many_waiters_get_a_429_and_a_dead_worker_is_a_server_fault(grammars):
    async def main():
        results: list[str] = []
        config = GrammarConfig(workers=1, timeout_s=300, max_waiting=0, limits=WIDE)
        pool = GrammarPool(grammars, config, results.append)
        try:
            slow = asyncio.ensure_future(pool.prepare(SLOW, None))
            await busy(pool)
            with pytest.raises(APIError) as e:
                await pool.prepare(GrammarSpec("regex", "[0-9]+"), None)
            assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
            os.kill(workers(pool)[0].proc.pid, signal.SIGKILL)  # the worker dies mid-compile
            with pytest.raises(GrammarFault):
                await slow
            assert (await pool.prepare(GrammarSpec("regex", "[0-9]+"), None)).compiled is not None
            assert results == ["busy", "failed", "compiled"]
        finally:
            await pool.close()

    run(main())


def test_without_a_vocabulary_grammars_are_checked_and_not_compiled():
    async def main():
        pool = GrammarPool(None, GrammarConfig(workers=1))
        try:
            ready = await pool.prepare(GrammarSpec("ebnf", 'root ::= "a"'), None)
            assert ready.spec.source == 'root ::= "a"' and ready.compiled is None
            with pytest.raises(APIError) as e:
                await pool.prepare(GrammarSpec("json_schema", json.dumps({"enum": list(range(40_000))})), None)
            assert (e.value.status, e.value.code) == (400, "grammar_too_complex") and "40000 enum" in e.value.message
            tools = await pool.prepare(None, parse_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None))
            assert "call_json" in tools.spec.source and tools.compiled is None
        finally:
            await pool.close()
        no_tokenizer = GrammarPool(Grammars(None, 8, [7]), GrammarConfig(workers=1))
        with pytest.raises(APIError) as e:
            await no_tokenizer.prepare(JSON_OBJECT, None)
        assert e.value.status == 400 and "tokenizer" in e.value.message

    run(main())
