"""One OpenAI completion request in flight: its choices, their backend streams, and the response shapes.

jobs (n choices x prompts) ──► backend.generate(job) per choice
open():    peek the first chunk of every choice (errors here become the HTTP status)
stream():  SSE: role chunks, content deltas (choices interleaved as they arrive), finish chunks,
           the usage chunk (stream_options.include_usage), `data: [DONE]`
collect(): one JSON body
close():   always; stops the pumps and closes every backend stream (aborting unfinished choices)
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from ..api.errors import APIError
from ..api.tools import ToolCallReader, split_output
from ..backends.base import Backend, Chunk, Job, SpecStats
from ..backends.telemetry import Telemetry


class ChatFormat:
    """`logprobs` arguments: a list of chat `logprobs.content` entries (Chunk.logprobs), or None."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    @staticmethod
    def choice(index: int, text: str, finish: str | None, logprobs: list[dict] | None = None, offset: int = 0) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": ChatFormat.logprobs(logprobs),
        }

    @staticmethod
    def delta(
        index: int,
        text: str | None = None,
        finish: str | None = None,
        role: bool = False,
        logprobs: list[dict] | None = None,
        offset: int = 0,
    ) -> dict:
        d: dict = {"role": "assistant", "content": ""} if role else {}
        if text:
            d["content"] = text
        return {"index": index, "delta": d, "finish_reason": finish, "logprobs": ChatFormat.logprobs(logprobs)}

    @staticmethod
    def logprobs(entries: list[dict] | None) -> dict | None:
        return None if entries is None else {"content": entries, "refusal": None}

    @staticmethod
    def tool_calls_delta(index: int, calls: list[dict]) -> dict:
        # NOTE: each call whole in one delta (OpenAI streams arguments in pieces; clients join them either way)
        return {
            "index": index,
            "delta": {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]},
            "finish_reason": None,
            "logprobs": None,
        }


class CompletionFormat:
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    @staticmethod
    def choice(index: int, text: str, finish: str | None, logprobs: list[dict] | None = None, offset: int = 0) -> dict:
        return {
            "index": index,
            "text": text,
            "finish_reason": finish,
            "logprobs": CompletionFormat.logprobs(logprobs, offset),
        }

    @staticmethod
    def delta(
        index: int,
        text: str | None = None,
        finish: str | None = None,
        role: bool = False,
        logprobs: list[dict] | None = None,
        offset: int = 0,
    ) -> dict:
        return {
            "index": index,
            "text": text or "",
            "finish_reason": finish,
            "logprobs": CompletionFormat.logprobs(logprobs, offset),
        }

    @staticmethod
    def logprobs(entries: list[dict] | None, offset: int) -> dict | None:
        """The legacy completions shape; text_offset counts the tokens' own texts from `offset` (the
        characters of the choice's earlier tokens)."""
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],  # None for an echoed prompt's first token
            "top_logprobs": [
                None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                for e in entries
            ],
            "text_offset": offsets,
        }


@dataclass
class Choice:
    job: Job
    stream: AsyncGenerator[Chunk, None]
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict] | None = None  # every entry so far, when the choice asked for logprobs
    offset: int = 0  # characters of the tokens already reported in logprobs (completions' text_offset)
    final: Chunk | None = None
    seen_token: bool = False
    t_last: float = 0.0
    tool_reader: ToolCallReader | None = None  # chat with tools: splits the streamed text into content and calls


class Generation:
    def __init__(
        self,
        backend: Backend,
        telemetry: Telemetry,
        jobs: list[Job],
        model: str,
        fmt,
        include_usage: bool = False,
        return_token_ids: bool = False,
    ):
        self.telemetry, self.model, self.fmt, self.include_usage = telemetry, model, fmt, include_usage
        self.return_token_ids = return_token_ids
        self.id = fmt.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.t0 = time.monotonic()
        self.choices = [
            Choice(
                j,
                backend.generate(j),
                t_last=self.t0,
                logprobs=None if j.params.logprobs is None else [],
                tool_reader=j.tools.reader() if j.tools else None,
            )
            for j in jobs
        ]
        self._firsts: list[Chunk] = []
        self._pumps: list[asyncio.Task] = []
        self.completed = False
        self.failed: APIError | None = None  # a stream that ended with an in-stream error event

    # --- lifecycle ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Wait for every choice's first chunk; the first error (by choice) is raised as is."""
        tasks = [asyncio.ensure_future(self._next(c)) for c in self.choices]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        errors: list[BaseException] = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
        if errors:
            raise next((e for e in errors if isinstance(e, APIError)), errors[0])
        self._firsts = [t.result() for t in tasks]

    async def close(self) -> None:
        for t in self._pumps:
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for c in self.choices:
            try:
                await c.stream.aclose()
            except Exception:  # noqa: BLE001 - closing must not fail the response; the stream already ended
                pass

    async def _next(self, c: Choice) -> Chunk:
        try:
            chunk = await anext(c.stream)
        except StopAsyncIteration:
            raise APIError(500, "the backend ended a generation without output", code="internal_error") from None
        self._observe(c, chunk)
        return chunk

    def _observe(self, c: Choice, chunk: Chunk) -> None:
        now = time.monotonic()
        if chunk.tokens:
            self.telemetry.tokens_out(not c.seen_token, now - c.t_last, chunk.tokens)
            c.seen_token, c.t_last = True, now
        c.parts.append(chunk.text)
        if c.logprobs is not None and chunk.logprobs:
            c.logprobs += chunk.logprobs
        if chunk.finish_reason:
            c.final = chunk
            if chunk.prediction_tokens:
                self.telemetry.prediction(*chunk.prediction_tokens)

    # --- non-streaming ------------------------------------------------------------------------
    async def collect(self) -> dict:
        await self._run_to_end()
        return self._body(
            self.fmt.object, [self._final_choice(c) for c in self.choices], usage=self._usage(), meta_info=self._meta()
        )

    async def _run_to_end(self) -> None:
        await self.open()
        await asyncio.gather(
            *(self._drain(c) for c, first in zip(self.choices, self._firsts) if not first.finish_reason)
        )
        self.completed = True

    async def _drain(self, c: Choice) -> None:
        while c.final is None:
            await self._next(c)

    def _final_choice(self, c: Choice) -> dict:
        assert c.final is not None
        text = "".join(c.parts)
        if c.job.tools is None:
            return self._extras(self.fmt.choice(c.job.index, text, c.final.finish_reason, c.logprobs), c.final)
        content, calls = split_output(text, c.job.tools)
        self.telemetry.tool_calls(len(calls))
        choice = self.fmt.choice(c.job.index, content, _finish_reason(c.final, calls), c.logprobs)
        if calls:
            choice["message"]["tool_calls"] = calls
        return self._extras(choice, c.final)

    def _extras(self, choice: dict, final: Chunk) -> dict:
        """Our per-choice extension fields: spec stats (meta_info) and, on request, token ids."""
        if final.spec is not None:
            choice["meta_info"] = final.spec.as_meta_info()
        if self.return_token_ids and final.token_ids is not None:
            choice["token_ids"] = final.token_ids
        return choice

    # --- streaming ----------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[str]:
        """SSE events after open(). Choices are pumped concurrently into one queue."""
        queue: asyncio.Queue = asyncio.Queue()
        for c, first in zip(self.choices, self._firsts):
            if not first.finish_reason:
                self._pumps.append(asyncio.create_task(self._pump(c, queue)))
        for event in self._head():
            yield event
        for c, first in zip(self.choices, self._firsts):
            for event in self._chunk_events(c, first):
                yield event
        pending = len(self._pumps)
        while pending:
            c, item = await queue.get()
            if isinstance(item, Exception):
                err = (
                    item
                    if isinstance(item, APIError)
                    else APIError(500, f"internal error: {type(item).__name__}", code="internal_error")
                )
                self.failed = err
                yield err.sse()
                yield "data: [DONE]\n\n"
                return
            for event in self._chunk_events(c, item):
                yield event
            pending -= item.finish_reason is not None
        for event in self._tail():
            yield event
        self.completed = True
        yield "data: [DONE]\n\n"

    def _head(self):
        """Events before the first chunk's: the chat role deltas."""
        if self.fmt is ChatFormat:
            yield self._sse([self.fmt.delta(c.job.index, role=True) for c in self.choices])

    def _tail(self):
        """Events after the last chunk's: the usage chunk, when asked."""
        if self.include_usage:
            yield self._sse([], usage=self._usage(), meta_info=self._meta())

    async def _pump(self, c: Choice, queue: asyncio.Queue) -> None:
        try:
            while c.final is None:
                chunk = await self._next(c)
                queue.put_nowait((c, chunk))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the response, which reports it in-stream
            queue.put_nowait((c, e))

    def _chunk_events(self, c: Choice, chunk: Chunk):
        # a chunk's logprobs are its tokens'; its text may lag them (held back: a split character, a
        # possible stop string), so an event may carry logprobs without text
        logprobs = chunk.logprobs if c.logprobs is not None and chunk.logprobs else None
        text = chunk.text if c.tool_reader is None else c.tool_reader.feed(chunk.text)
        if text or logprobs:
            yield self._sse([self.fmt.delta(c.job.index, text, logprobs=logprobs, offset=c.offset)])
            c.offset += sum(len(e["token"]) for e in logprobs or ())
        if not chunk.finish_reason:
            return
        calls: list[dict] = []
        if c.tool_reader is not None:
            rest, calls = c.tool_reader.finish()
            self.telemetry.tool_calls(len(calls))
            if rest:
                yield self._sse([self.fmt.delta(c.job.index, rest)])
            if calls:
                yield self._sse([ChatFormat.tool_calls_delta(c.job.index, calls)])
        yield self._sse([self._extras(self.fmt.delta(c.job.index, finish=_finish_reason(chunk, calls)), chunk)])

    def _sse(self, choices: list[dict], **extra) -> str:
        body = self._body(self.fmt.chunk_object, choices, **extra)
        if self.include_usage and "usage" not in body:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    # --- shared -------------------------------------------------------------------------------
    def _body(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _usage(self) -> dict:
        prompt = {c.job.prompt_group: c.final.prompt_tokens or 0 for c in self.choices if c.final}
        completion = sum(c.final.completion_tokens or 0 for c in self.choices if c.final)
        p = sum(prompt.values())
        usage: dict = {"prompt_tokens": p, "completion_tokens": completion, "total_tokens": p + completion}
        cached: dict[int, int] = {}  # per prompt: the fewest tokens any of its choices took from the prefix cache
        for c in self.choices:
            if c.final and c.final.cached_tokens is not None:
                g = c.job.prompt_group
                cached[g] = min(cached.get(g, c.final.cached_tokens), c.final.cached_tokens)
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
        predicted = [c.final.prediction_tokens for c in self.choices if c.final and c.final.prediction_tokens]
        if predicted:
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(a for a, _ in predicted),
                "rejected_prediction_tokens": sum(r for _, r in predicted),
            }
        return usage

    def _meta(self) -> dict:
        total = SpecStats()
        for c in self.choices:
            if c.final and c.final.spec:
                total = total + c.final.spec
        return total.as_meta_info()


def _finish_reason(final: Chunk, calls: list[dict]) -> str | None:
    """ "tool_calls" when a reply that ended by itself made calls (a cut-off one stays "length")."""
    return "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason
