"""The embedded backend: our speculative Engine in this process, driven by the EngineLoop's thread."""

from __future__ import annotations

import asyncio
import difflib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from sglang_ext.sampling import InvalidRequest, SamplingParams, TokenLogprob

from ..api.errors import APIError, invalid
from ..engine import Engine
from ..engine_loop import Delivery, EngineLoop, EngineLoopClosed, Handle, QueueFull, fault_message
from ..grammar_pool import GrammarConfig, GrammarFault, GrammarPool
from .base import Admission, Chunk, Job, KVCacheUsage, SpecStats
from .detok import IncrementalText, TokenStrings
from .telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedLimits:
    """The embedded backend's own limits (admission: base.Admission; a request's max_tokens: the gateway's Limits)."""

    default_max_tokens: int = 512  # when a request gives none (KV is reserved for the worst case)
    max_prompt_tokens: int | None = None  # None: the model's context
    grammar: GrammarConfig = GrammarConfig()  # structured output's compile workers, budget and limits


class EmbeddedBackend:
    kind = "embedded"

    def __init__(
        self,
        engine: Engine,
        model_ids: list[str],
        drafter: str,
        telemetry: Telemetry,
        limits: EmbeddedLimits = EmbeddedLimits(),
        admission: Admission | None = None,
    ):
        self.engine, self.target, self.model_ids, self.drafter = engine, engine.target, model_ids, drafter
        self.limits, self.admission, self.telemetry = limits, admission or Admission(), telemetry
        engine.on_fallback = lambda req, reason: telemetry.fallback(reason)
        self.engine_loop = EngineLoop(
            engine, max_running=self.admission.max_running, max_queue=self.admission.max_queue, telemetry=telemetry
        )
        # tokens (prompt + output) one request may hold: the model's context, or less if the KV pool is smaller
        self.max_context = min(engine.max_context - 1, self.engine_loop.capacity())
        self.max_prompt_tokens = min(limits.max_prompt_tokens or self.max_context - 1, self.max_context - 1)
        self.token_strings = TokenStrings(self.target.tokenizer)
        self.grammar_pool = GrammarPool(engine.grammars, limits.grammar, telemetry.grammar_work)

    async def start(self) -> None:
        self.engine_loop.start()

    async def close(self) -> None:
        await self.grammar_pool.close()
        await asyncio.to_thread(self.engine_loop.stop)

    async def not_ready_reason(self) -> str | None:
        return None if self.engine_loop.alive else "the engine thread is not running"

    def load(self) -> tuple[int, int]:
        return self.engine_loop.load()

    def abort_all(self) -> None:
        self.engine_loop.abort_all()

    def kv_cache(self) -> KVCacheUsage:
        return self.engine_loop.kv_cache()

    async def flush_cache(self) -> tuple[bool, str]:
        """Empty the engine's prefix cache between two steps. Requests running keep the cached prefixes they use
        until they end (then those are freed too); no request is disturbed either way."""
        if self.engine.prefix_cache is None:
            return True, "the prefix cache is off (--no-prefix-cache): nothing to flush"
        try:
            done = await asyncio.wrap_future(self.engine_loop.flush_cache())
        except EngineLoopClosed as e:
            raise APIError(503, str(e), code="service_unavailable") from e
        message = f"Cache flushed: {done.freed} cached tokens freed."
        if done.kept:
            message += (
                f" {done.kept} cached tokens in use by {done.running} running requests left the cache and are freed "
                "when those requests end."
            )
        return True, message

    # --- one choice ---------------------------------------------------------------------------
    def tokenize(self, job: Job) -> list[int]:
        if job.messages is not None:
            try:
                ids = self.target.encode_chat(list(job.messages), job.continue_final)
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault (e.g. roles out of order)
                raise invalid(f"messages could not be formatted with the model's chat template: {e}", "messages") from e
        elif isinstance(job.prompt, str):
            ids = self.target.encode(job.prompt)
        else:
            ids = list(job.prompt or ())
            vocab = self.target.cfg.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise invalid(f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids

    def detokenize(self, ids: list[int]) -> str:
        vocab = self.target.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise invalid(f"token ids must be in [0, {vocab})", "tokens")
        return self.target.tokenizer.decode(ids, skip_special_tokens=False)

    def context_length(self) -> int:
        return self.max_context

    def prompt_ids(self, job: Job) -> list[int]:
        ids = self.tokenize(job)
        if not ids:
            raise invalid("the prompt is empty", "messages" if job.messages is not None else "prompt")
        if len(ids) > self.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt_tokens}",
                param="messages" if job.messages is not None else "prompt",
                code="context_length_exceeded",
            )
        return ids

    def sampling_params(self, job: Job, prompt_len: int) -> SamplingParams:
        p = job.params
        room = self.max_context - prompt_len
        if p.max_tokens is None:
            max_new = min(self.limits.default_max_tokens, room)
        elif p.max_tokens > room:
            raise APIError(
                400,
                f"this server's context is {self.max_context} tokens; the prompt has {prompt_len} and max_tokens asks "
                f"for {p.max_tokens}. Lower max_tokens or shorten the prompt.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_new = max(p.max_tokens, 1)  # 0 (echo: score the prompt only): one token is generated and dropped
        if p.logprob_start_len is not None and not 0 <= p.logprob_start_len < prompt_len:
            raise invalid(
                f"logprob_start_len must be -1 (output tokens only) or a prompt position from 0 to {prompt_len - 1} "
                f"(the prompt has {prompt_len} tokens), got {p.logprob_start_len}",
                "logprob_start_len",
            )
        try:
            params = SamplingParams(
                max_new,
                p.temperature,
                p.top_p,
                p.top_k,
                p.seed,
                tuple(p.stop_token_ids),
                p.ignore_eos,
                p.logprobs,
                prompt_logprobs=p.logprobs if p.echo or p.prompt_logprobs else None,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty,
                logit_bias=p.logit_bias,
                grammar=p.grammar,
                min_tokens=p.min_tokens,
                prediction=tuple(self.target.encode(p.prediction)) if p.prediction else (),
            )
            params.check_vocab(self.target.cfg.vocab_size)
        except InvalidRequest as e:
            raise invalid(str(e), e.param) from e
        return params

    def echo_logprobs(self, ids: list[int], prompt_logprobs: list | None) -> list[dict] | None:
        """An echoed prompt's logprobs entries: the first token has none (no context), as in OpenAI's API."""
        if prompt_logprobs is None:
            return None
        return [
            {**self.token_strings.entry(ids[0], None), "top_logprobs": None},
            *self.token_strings.entries(prompt_logprobs),
        ]

    async def generate(self, job: Job) -> AsyncGenerator[Chunk, None]:
        ids = self.prompt_ids(job)
        params, grammar = await self._grammar(job, self.sampling_params(job, len(ids)))
        handle = self._submit(ids, params, grammar, job)
        out = _Output(self, job, ids)
        try:
            while True:
                d = await handle.next()
                if d.finish_reason == "rejected":  # pushed out of the queue by a tenant with a shorter one
                    raise _busy(d.error, d.retry_after or 1)
                if d.error:
                    raise invalid(d.error, None) if d.invalid else APIError(500, d.error, code="internal_error")
                if d.finish_reason == "abort":
                    raise APIError(
                        503, "the request was aborted: the server is shutting down", code="service_unavailable"
                    )
                try:
                    chunk, stopped = out.chunk(d)
                    if chunk.finish_reason and params.prediction:
                        chunk.prediction_tokens = await asyncio.to_thread(
                            prediction_usage, params.prediction, chunk.token_ids
                        )
                except Exception as e:  # noqa: BLE001 - this request's fault alone
                    raise self._fault("detokenize") from e
                if stopped or job.params.max_tokens == 0:
                    handle.cancel()  # frees the KV now (tokens after a stop string, echo's sampled token: dropped)
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            handle.cancel()  # client gone / sibling failed / generator closed early: no-op once finished

    async def _grammar(self, job: Job, params: SamplingParams) -> tuple[SamplingParams, object | None]:
        """The request's grammar compiled by the compile workers (its client waits here, not the engine), and
        its params with the grammar made from its tools when a call is required."""
        try:
            prepared = await self.grammar_pool.prepare(params.grammar, job.tools)
        except GrammarFault as e:
            raise self._fault("grammar") from e
        if prepared is None:
            return params, None
        if prepared.spec != params.grammar:
            try:
                params = replace(params, grammar=prepared.spec)
            except InvalidRequest as e:
                raise invalid(str(e), e.param) from e
        return params, prepared.compiled

    def _submit(self, ids: list[int], params: SamplingParams, grammar: object | None, job: Job) -> Handle:
        try:
            return self.engine_loop.submit(ids, params, grammar=grammar, tenant=job.tenant, owner=job.owner)
        except QueueFull as e:
            raise _busy(str(e), e.retry_after) from e
        except EngineLoopClosed as e:
            raise APIError(503, str(e), code="service_unavailable", headers={"Retry-After": "5"}) from e
        except InvalidRequest as e:
            raise invalid(str(e), e.param) from e

    def _fault(self, reason: str) -> APIError:
        """A fault turning this request's tokens into its response: it fails alone (logged, counted by reason)."""
        log.exception("request failed in stage %r; the other requests carry on", reason)
        self.telemetry.fault(reason)
        return APIError(500, fault_message(reason), code="internal_error")


class _Output:
    """One choice's deliveries -> Chunks: incremental text with stop strings, echo, logprob entries."""

    def __init__(self, backend: EmbeddedBackend, job: Job, ids: list[int]):
        self.backend, self.job, self.ids = backend, job, ids
        self.text = IncrementalText(backend.target.decode, job.params.stop)
        self.produced = 0
        # echo: the prompt as given (token ids decoded), then the completion; stop strings apply to the completion
        self.echo = ""
        if job.params.echo:
            decode = backend.target.tokenizer.decode
            self.echo = job.prompt if isinstance(job.prompt, str) else decode(ids, skip_special_tokens=False)

    def chunk(self, d: Delivery) -> tuple[Chunk, bool]:
        """The Chunk of one delivery, and whether a stop string ended the text there."""
        ids, echo = self.ids, self.job.params.echo
        if self.job.params.max_tokens == 0:  # echo only: the prompt (and its logprobs); the sampled token is dropped
            lps = self.backend.echo_logprobs(ids, d.prompt_logprobs) if echo else None
            return Chunk(
                self.echo,
                0,
                "length",
                prompt_tokens=len(ids),
                completion_tokens=0,
                spec=SpecStats(),
                token_ids=[],
                cached_tokens=d.cached_tokens,
                logprobs=lps,
                prompt_token_logprobs=_with_first(ids, d.prompt_logprobs),
            ), False
        self.produced += len(d.tokens)
        delta, stopped = self.text.push(d.tokens, final=d.finish_reason is not None)
        finish = "stop" if stopped else d.finish_reason
        # tokens past the one that completed a stop string are dropped (with their logprobs)
        keep = self.text.tokens_through_stop(len(d.tokens)) if stopped else len(d.tokens)
        chunk = Chunk(self.echo + delta, len(d.tokens), finish, ids=list(d.tokens[:keep]))
        if d.logprobs is not None:
            chunk.token_logprobs = d.logprobs[:keep]
            chunk.logprobs = self.backend.token_strings.entries(chunk.token_logprobs)
            if d.prompt_logprobs is not None and echo:
                chunk.logprobs = self.backend.echo_logprobs(ids, d.prompt_logprobs) + chunk.logprobs
        chunk.prompt_token_logprobs = _with_first(ids, d.prompt_logprobs)
        self.echo = ""
        if finish:
            chunk.prompt_tokens, chunk.completion_tokens = len(ids), self.produced
            chunk.cached_tokens = d.cached_tokens
            chunk.spec = SpecStats(d.verify_steps, d.draft_tokens, d.accepted_tokens)
            chunk.token_ids = list(self.text.ids)
        return chunk, stopped


def _busy(message: str, retry_after: int) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})


def _with_first(ids: list[int], prompt_logprobs: list | None) -> list | None:
    """The prompt's TokenLogprobs from its first token on (which has no context: logprob None)."""
    return None if prompt_logprobs is None else [TokenLogprob(ids[0], None), *prompt_logprobs]


def prediction_usage(prediction: tuple[int, ...], output: list[int]) -> tuple[int, int]:
    """(accepted, rejected): prediction tokens that appear in the output, in order (difflib's matching
    blocks), and the rest, as OpenAI's usage.completion_tokens_details reports them."""
    matcher = difflib.SequenceMatcher(None, prediction, output, autojunk=False)
    accepted = sum(b.size for b in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted
