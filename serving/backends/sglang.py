"""The upstream backend: an SGLang server (running our plugin on GPU nodes) behind its OpenAI API.

Every choice is one streamed upstream request (n=1, `stream_options.include_usage`), so the gateway
measures TTFT/ITL itself and a client disconnect closes the upstream connection (SGLang then aborts
the request). Speculative stats come from SGLang's `sglext.spec_tokens_details` (requested with
`return_spec_tokens_details`, SGLang >= 0.5) or a `meta_info` object (older servers, other gateways).
Stop strings, tokenization and prompt limits are the upstream's job. At the drain deadline `abort_all`
closes the open upstream streams: their clients get an OpenAI-shaped 503 error event, then `[DONE]`.
The upstream's radix cache is kept per tenant as ours is: a request's tenant (its API key and cache_salt,
digested) goes upstream as SGLang's `cache_salt`; /flush_cache is the upstream's.

The gateway holds the line in front of the upstream with the embedded engine's fair admission
(serving/tenancy.py): at most `max_running` upstream requests at once (more only while a tenant under its
share is let in), the rest in a FairQueue of `max_queue`, each tenant's turn by the tokens it may use (prompt
characters / 4, as OpenAI estimates for its limits, + max_tokens), settled to the upstream's usage at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import httpx

from sglang_ext.grammar import JSON_OBJECT, GrammarSpec

from ..api.errors import APIError
from ..engine_loop import fault_message
from ..grammar_pool import GrammarConfig, GrammarFault, GrammarPool
from ..tenancy import AsyncAdmission, Refused
from .base import Admission, Chunk, Job, SpecStats
from .detok import logprob_entry
from .telemetry import Telemetry

_FINISH = {"stop": "stop", "length": "length", "eos": "stop"}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpstreamConfig:
    url: str
    model: str | None = None  # name sent upstream; default: the first id of the upstream's /v1/models
    timeout_s: float = 600.0  # read timeout between upstream bytes
    api_key: str | None = None  # sent upstream as Bearer (SGLang --api-key)
    grammar: GrammarConfig = GrammarConfig()  # grammars are checked (and tool-call grammars built) here
    default_max_tokens: int = 512  # the admission cost of a request without max_tokens (the upstream applies its own)


def spec_from_payload(obj: dict) -> SpecStats | None:
    """Spec stats from an upstream response object (SGLang sglext, legacy meta_info, or our own meta_info)."""
    found = []
    details = (obj.get("sglext") or {}).get("spec_tokens_details")
    found += details if isinstance(details, list) else [details] if details else []
    for holder in [obj, *(obj.get("choices") or [])]:
        if isinstance(holder.get("meta_info"), dict):
            found.append(holder["meta_info"])
    for d in found:
        verify = int(d.get("spec_verify_ct") or 0)
        if verify:
            drafted = d.get("spec_num_proposed_drafts", d.get("spec_draft_tokens", 0)) or 0
            accepted = d.get("spec_num_correct_drafts", d.get("spec_accepted_tokens", 0)) or 0
            return SpecStats(verify, int(drafted), int(accepted))
    return None


def _histogram(obj: dict) -> list[int] | None:
    details = (obj.get("sglext") or {}).get("spec_tokens_details")
    return details.get("spec_correct_drafts_histogram") if isinstance(details, dict) else None


class SGLangBackend:
    kind = "sglang"
    READY_TTL = 1.0  # seconds a readiness answer is reused (probes and load balancers poll /ready often)

    def __init__(
        self,
        config: UpstreamConfig,
        model_ids: list[str],
        drafter: str,
        telemetry: Telemetry,
        admission: Admission | None = None,  # max_running: concurrent upstream requests (HTTP connections)
        clock=time.monotonic,
    ):
        self.config, self.model_ids, self.drafter, self.telemetry = config, model_ids, drafter, telemetry
        limits = admission or Admission()
        self.max_running = limits.max_running
        self.clock = clock  # () -> seconds; the readiness cache's (tests step it instead of sleeping)
        self._http: httpx.AsyncClient | None = None
        self._in_flight = 0
        self._tokens = 0  # streamed chunks since the last throughput tick
        self._ready_cache: tuple[float, str | None] = (0.0, "not checked yet")
        self._upstream_model = config.model
        self._ticker: asyncio.Task | None = None
        self._open: set[httpx.Response] = set()  # the upstream streams of the running generate() calls
        self._aborted: set[httpx.Response] = set()  # those closed by abort_all (their requests end with a 503)
        self._closing: set[asyncio.Task] = set()
        self._aborting = False  # the drain deadline passed: no new upstream request
        # grammars are checked and converted here; the upstream compiles them
        self.grammar_pool = GrammarPool(None, config.grammar, telemetry.grammar_work)
        self.admission = AsyncAdmission(limits.max_running, limits.max_queue, telemetry.tenants)

    def tokenize(self, job: Job) -> list[int]:
        raise _no_tokenizer()

    def detokenize(self, ids: list[int]) -> str:
        raise _no_tokenizer()

    def context_length(self) -> int | None:
        return None

    def kv_cache(self) -> None:
        return None  # SGLang exports its own (sglang:token_usage)

    async def flush_cache(self) -> tuple[bool, str]:
        """The upstream's /flush_cache (SGLang refuses while it has requests: its message says so)."""
        try:
            r = await self._client.post("/flush_cache", timeout=30.0)
        except httpx.HTTPError as e:
            raise APIError(502, f"upstream /flush_cache failed: {type(e).__name__}", code="upstream_error") from e
        return r.status_code == 200, f"upstream: {r.text.strip()[:500]}"

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.config.url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(connect=5.0, read=self.config.timeout_s, write=30.0, pool=None),
            limits=httpx.Limits(  # (admission lets up to 2 x max_running through: see serving/tenancy.py)
                max_connections=2 * self.max_running, max_keepalive_connections=self.max_running
            ),
            trust_env=False,  # in-cluster traffic must not go through an HTTP(S)_PROXY from the environment
        )
        self._ticker = asyncio.create_task(self._tick())

    async def close(self) -> None:
        await self.grammar_pool.close()
        if self._ticker:
            self._ticker.cancel()
        if self._http:
            await self._http.aclose()

    @property
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("the backend is not started")
        return self._http

    def load(self) -> tuple[int, int]:
        return self.admission.load()

    def abort_all(self) -> None:
        """Close every open upstream stream (drain deadline passed; called on the event loop thread).

        The pending reads end at once; each request then fails with a 503 (an in-stream error event),
        and closing the upstream connection makes SGLang abort the request."""
        self._aborting = True
        self.admission.abort_waiting(_aborted)
        loop = asyncio.get_running_loop()
        for r in self._open - self._aborted:
            self._aborted.add(r)
            task = loop.create_task(_close_quietly(r))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def not_ready_reason(self) -> str | None:
        t, reason = self._ready_cache
        if self.clock() - t < self.READY_TTL:
            return reason
        try:
            r = await self._client.get("/health", timeout=3.0)
            if r.status_code == 404:  # not SGLang: any OpenAI server lists its models
                r = await self._client.get("/v1/models", timeout=3.0)
            reason = None if r.status_code == 200 else f"upstream {self.config.url} answered {r.status_code}"
        except httpx.HTTPError as e:
            reason = f"upstream {self.config.url} unreachable: {type(e).__name__}"
        self._ready_cache = (self.clock(), reason)
        return reason

    async def _model(self) -> str:
        if self._upstream_model is None:
            try:
                r = await self._client.get("/v1/models", timeout=5.0)
                self._upstream_model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                return self.model_ids[0]
        return self._upstream_model

    async def _tick(self) -> None:
        """Once a second: recent tokens/s by concurrency bucket (upstream batches are not visible here)."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if self._in_flight:
                self.telemetry.batch_size.observe(self._in_flight)
                self.telemetry.throughput(self._in_flight, self._tokens, now - last)
            self._tokens, last = 0, now
            self.telemetry.occupancy(*self.load())

    async def _grammar(self, job: Job) -> GrammarSpec | None:
        """The grammar sent upstream: the request's, checked against the limits, or the tool-call grammar."""
        try:
            prepared = await self.grammar_pool.prepare(job.params.grammar, job.tools)
        except GrammarFault as e:
            log.error("grammar work failed; the other requests carry on", exc_info=e)
            self.telemetry.fault("grammar")
            raise APIError(500, fault_message("grammar"), code="internal_error") from e
        return None if prepared is None else prepared.spec

    async def _payload(self, job: Job, grammar: GrammarSpec | None) -> tuple[str, dict]:
        p = job.params
        body: dict = {
            "model": await self._model(),
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_spec_tokens_details": True,
        }
        body.update(temperature=p.temperature, top_p=p.top_p)
        for key, value in (("max_tokens", p.max_tokens), ("seed", p.seed)):
            if value is not None:
                body[key] = value
        if p.stop:
            body["stop"] = list(p.stop)
        if p.top_k:
            body["top_k"] = p.top_k
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.min_tokens:
            body["min_tokens"] = p.min_tokens
        for key, value, off in (
            ("presence_penalty", p.presence_penalty, 0.0),
            ("frequency_penalty", p.frequency_penalty, 0.0),
            ("repetition_penalty", p.repetition_penalty, 1.0),
        ):
            if value != off:
                body[key] = value
        if p.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in p.logit_bias}
        if grammar is not None:
            body.update(_grammar_fields(grammar))
        if job.tenant:
            body["cache_salt"] = job.tenant
        if job.messages is not None:
            if p.logprobs is not None:
                body.update(logprobs=True, top_logprobs=p.logprobs)
            if job.continue_final:
                body["continue_final_message"] = True
            return "/v1/chat/completions", {**body, "messages": list(job.messages)}
        if p.logprobs is not None:
            body["logprobs"] = p.logprobs
        if p.echo:
            body["echo"] = True
        return "/v1/completions", {
            **body,
            "prompt": job.prompt if isinstance(job.prompt, str) else list(job.prompt or ()),
        }

    async def generate(self, job: Job) -> AsyncGenerator[Chunk, None]:
        if self._aborting:
            raise _aborted()
        path, body = await self._payload(job, await self._grammar(job))
        ticket = await self._admit(job)
        self._in_flight += 1
        r: httpx.Response | None = None
        final: Chunk | None = None
        try:
            async with self._client.stream("POST", path, json=body) as r:
                self._open.add(r)
                if self._aborting:  # opened after the drain deadline (it waited for a connection)
                    self._aborted.add(r)
                    raise _aborted()
                if r.status_code != 200:
                    raise await _upstream_error(r)
                async for chunk in self._chunks(r, job.messages is not None):
                    final = chunk if chunk.finish_reason else final
                    yield chunk
        except Exception as e:
            if r is not None and r in self._aborted:  # the stream ended or failed because abort_all closed it
                raise _aborted() from e
            if isinstance(e, APIError):
                raise
            raise self._failure(e) from e
        finally:
            self._in_flight -= 1
            if final is None or final.prompt_tokens is None:
                self.admission.leave(ticket)  # (tokens unknown: the estimate stands)
            else:
                self.admission.leave(ticket, final.prompt_tokens, final.completion_tokens or 0)
            if r is not None:
                self._open.discard(r)
                self._aborted.discard(r)

    async def _admit(self, job: Job):
        """Wait for this request's turn in front of the upstream (429 when its tenant's share of the queue is full)."""
        out = self.config.default_max_tokens if job.params.max_tokens is None else job.params.max_tokens
        try:
            return await self.admission.enter(job.owner, _prompt_estimate(job) + out)
        except Refused as e:
            if e.reason == "too_large":
                raise APIError(400, str(e), param="max_tokens", code="invalid_value") from e
            raise APIError(
                429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after or 1)}
            ) from e

    def _failure(self, e: Exception) -> APIError:
        """An upstream failure (not an abort) -> this request's error."""
        if isinstance(e, httpx.TimeoutException):
            return APIError(504, f"upstream timed out: {type(e).__name__}", code="upstream_timeout")
        if isinstance(e, httpx.HTTPError):
            return APIError(502, f"upstream request failed: {type(e).__name__}: {e}", code="upstream_error")
        # an upstream reply this gateway cannot read fails this request alone
        log.error("unreadable upstream response; the other requests carry on", exc_info=e)
        self.telemetry.fault("upstream_response")
        unreadable = f"the upstream sent a response this gateway cannot read ({type(e).__name__})"
        return APIError(502, unreadable, code="upstream_error")

    async def _chunks(self, r: httpx.Response, chat: bool) -> AsyncGenerator[Chunk, None]:
        finish, spec, hist = None, None, None
        usage: dict = {}
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                raise APIError(502, f"upstream error: {err.get('message')}", code="upstream_error")
            spec = spec_from_payload(obj) or spec
            hist = _histogram(obj) or hist
            usage = obj.get("usage") or usage
            for c in obj.get("choices") or []:
                text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if c.get("finish_reason"):
                    if c["finish_reason"] not in _FINISH:
                        raise APIError(
                            502, f"upstream finished the request with {c['finish_reason']!r}", code="upstream_error"
                        )
                    finish = _FINISH[c["finish_reason"]]
                logprobs = _logprob_entries(c.get("logprobs"), chat)
                if text or logprobs:
                    self._tokens += 1
                    yield Chunk(text or "", 1, logprobs=logprobs)
        if finish is None:
            raise APIError(502, "upstream stream ended without a finish_reason", code="upstream_error")
        final = Chunk("", 0, finish, usage.get("prompt_tokens"), usage.get("completion_tokens"), spec)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        final.cached_tokens = cached if isinstance(cached, int) else None
        self._account(final, hist)
        yield final

    def _account(self, final: Chunk, hist: list[int] | None) -> None:
        t = self.telemetry
        t.prompt_tokens.inc(final.prompt_tokens or 0)
        t.generated_tokens.inc(final.completion_tokens or 0)
        if final.cached_tokens is not None and final.prompt_tokens:
            t.prefix_cache(final.prompt_tokens, final.cached_tokens)
        if final.spec:
            t.spec_totals(final.spec.verify_steps, final.spec.draft_tokens, final.spec.accepted_tokens, hist)


def _prompt_estimate(job: Job) -> int:
    """Prompt tokens, estimated (the gateway holds no tokenizer): 4 characters a token, as OpenAI's rate limits
    estimate; token ids as given."""
    if job.messages is not None:
        chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0 for m in job.messages)
        return -(-chars // 4) + 4 * len(job.messages)  # (a few template tokens per message)
    if isinstance(job.prompt, str):
        return -(-len(job.prompt) // 4)
    return len(job.prompt or ())


def _logprob_entries(obj: dict | None, chat: bool) -> list[dict] | None:
    """An upstream chunk's logprobs as chat `logprobs.content` entries (the chat shape passes through;
    the legacy completions shape is converted, bytes from the token text)."""
    if not obj:
        return None

    def entry(e: dict) -> dict:
        return logprob_entry(e["token"], e["logprob"], e.get("bytes") or None)

    if chat:
        return [
            {**entry(e), "top_logprobs": [entry(t) for t in e.get("top_logprobs") or ()]}
            for e in obj.get("content") or ()
        ] or None
    tops = obj.get("top_logprobs") or [None] * len(obj.get("tokens") or ())
    return [
        {**logprob_entry(t, lp), "top_logprobs": [logprob_entry(k, v) for k, v in (top or {}).items()]}
        for t, lp, top in zip(obj.get("tokens") or (), obj.get("token_logprobs") or (), tops)
    ] or None


async def _upstream_error(r: httpx.Response) -> APIError:
    """An upstream error response -> the same error for our client (5xx become 502)."""
    raw = await r.aread()
    try:
        err = json.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else {"message": str(err)}
        if isinstance(err, str):
            err = {"message": err}
    except ValueError:
        err = {"message": raw.decode(errors="replace")[:500]}
    message = str(err.get("message") or err.get("detail") or f"upstream answered {r.status_code}")
    if 400 <= r.status_code < 500:
        headers = {"Retry-After": r.headers["retry-after"]} if "retry-after" in r.headers else None
        code, param = err.get("code"), err.get("param")
        return APIError(
            r.status_code,
            message,
            param=param if isinstance(param, str) else None,
            code=code if isinstance(code, str) else None,
            headers=headers,
        )
    return APIError(502, f"upstream error {r.status_code}: {message}", code="upstream_error")


def _grammar_fields(g: GrammarSpec) -> dict:
    """A grammar as SGLang's OpenAI API takes it (response_format, or its regex / ebnf extensions)."""
    if g == JSON_OBJECT:
        return {"response_format": {"type": "json_object"}}
    if g.kind == "json_schema":
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "response", "schema": json.loads(g.source)},
            }
        }
    return {g.kind: g.source}


def _aborted() -> APIError:
    return APIError(
        503, "the server is shutting down: the request was aborted at the drain deadline", code="service_unavailable"
    )


async def _close_quietly(r: httpx.Response) -> None:
    try:
        await r.aclose()
    except Exception:  # noqa: BLE001 - the stream is being torn down; its request reports the abort
        log.debug("closing an upstream stream at the drain deadline failed", exc_info=True)


def _no_tokenizer() -> APIError:
    return APIError(
        400,
        "tokenize / detokenize are not available with the sglang backend (the gateway holds no tokenizer): call the "
        "upstream SGLang server's /tokenize and /detokenize",
        code="unsupported_parameter",
    )
