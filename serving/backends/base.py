"""The one interface every serving backend implements (embedded engine, upstream SGLang).

The gateway turns an OpenAI request into one `Job` per choice (n choices x prompts) and runs each
through `Backend.generate`, an async iterator of `Chunk`s:

    job ──► backend.generate(job) ──► Chunk(text="Hel", tokens=1) ... Chunk(text="lo", tokens=2, finish_reason="stop")

Errors raised before the first chunk become the HTTP status of the response (the gateway peeks the
first chunk of every choice before it sends headers); later errors end a stream with an error event.
Closing the iterator (client gone, sibling choice failed) aborts the generation and frees its KV.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from sglang_ext.grammar import GrammarSpec

from ..api.errors import APIError
from ..api.tools import ToolCalling
from ..engine_loop import KVCacheUsage
from ..tenancy import DEFAULT_TENANT, Tenant


@dataclass(frozen=True)
class Admission:
    """How many requests a backend runs at once, and how many more may wait before new ones get 429 + Retry-After
    (--max-running, --max-queue): one pair for either backend (the embedded engine's loop, or the upstream's
    connections)."""

    max_running: int = 64
    max_queue: int = 256


@dataclass(frozen=True)
class GenParams:
    """Sampling and stopping for one choice (already validated by the gateway schemas)."""

    max_tokens: int | None = None  # None: as many as the context allows (capped by the server limit)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (extension, as in SGLang/vLLM)
    seed: int | None = None
    stop: tuple[str, ...] = ()  # text-level stop strings, excluded from the output
    stop_token_ids: tuple[int, ...] = ()  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = 0  # extension: no EOS / stop_token_ids before this many tokens
    logprobs: int | None = None  # None: off; k: each token's logprob and its k likeliest alternatives
    echo: bool = False  # completions: the output starts with the prompt (and its logprobs, when asked)
    prompt_logprobs: bool = (
        False  # the prompt's logprobs (with `logprobs` alternatives) without echoing it (SGLang's /generate)
    )
    logprob_start_len: int | None = None  # /generate: the first prompt position reported (< the prompt's length)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (SGLang/vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    grammar: GrammarSpec | None = None  # structured output (response_format, regex, ebnf)
    prediction: str = ""  # predicted output (chat `prediction`): drafts from it, never changes the output


@dataclass(frozen=True)
class Job:
    """One choice to generate: a chat (messages) or a completion (text or token ids) prompt."""

    index: int  # choice index in the response
    messages: tuple[dict, ...] | None = None  # chat: [{"role", "content": str}]
    continue_final: bool = False  # chat: the reply continues the last (assistant) message (continue_final_message)
    prompt: str | tuple[int, ...] | None = None  # completion: text or token ids
    params: GenParams = field(default_factory=GenParams)
    prompt_group: int = 0  # completions with a list of prompts: which prompt (usage counts each once)
    # chat tool calling: the gateway reads calls out of the text; a backend has its tools checked, and the call
    # grammar built when a call is required, by its compile workers (serving/grammar_pool.py)
    tools: ToolCalling | None = None
    # the prefix cache's (and the suffix drafter's online corpus's) namespace: a digest of the API key and the
    # request's cache_salt (gateway/auth.py: tenant_key); "" shared by every request with neither
    tenant: str = ""
    # whose request this is (its API key's tenant): fair admission's queue, shares and limits, per-tenant metrics
    owner: Tenant = DEFAULT_TENANT


@dataclass
class SpecStats:
    """Speculative-decoding totals for a request (SGLang meta_info naming in `as_meta_info`)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """tau: mean tokens committed per verify step (accepted + 1 bonus)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def __add__(self, other: SpecStats) -> SpecStats:
        return SpecStats(
            self.verify_steps + other.verify_steps,
            self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
        )

    def as_meta_info(self) -> dict:
        return {
            "spec_accept_length": round(self.accept_length, 4),
            "spec_accept_rate": round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else 0.0,
            "spec_verify_ct": self.verify_steps,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
        }


@dataclass
class Chunk:
    """A piece of one choice's output. The last chunk has finish_reason, usage and spec stats."""

    text: str = ""
    tokens: int = 0  # completion tokens produced since the previous chunk (timing metrics)
    finish_reason: str | None = None  # "stop" | "length" on the last chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    spec: SpecStats | None = None
    token_ids: list[int] | None = None  # all completion token ids, on the last chunk (embedded backend)
    ids: list[int] | None = None  # this chunk's completion token ids, when the backend knows them (embedded)
    logprobs: list[dict] | None = None  # when asked: one OpenAI chat `logprobs.content` entry per token of this chunk
    token_logprobs: list | None = (
        None  # the same as sglang_ext.sampling.TokenLogprob (token ids), when asked (embedded)
    )
    prompt_token_logprobs: list | None = (
        None  # TokenLogprob of every prompt token (the first's logprob None), with the first chunk, when asked
    )
    prediction_tokens: tuple[int, int] | None = (
        None  # with a prediction, on the last chunk: (accepted, rejected) prediction tokens
    )
    cached_tokens: int | None = None  # on the last chunk: prompt tokens taken from the prefix cache, when known


class Backend(Protocol):
    kind: str  # metric label `backend`: "embedded" | "sglang"
    drafter: str  # metric label `drafter`
    model_ids: list[str]  # names accepted in the `model` field; the first is the default

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def not_ready_reason(self) -> str | None:
        """None when requests can be served now, else why not (GET /ready)."""
        ...

    def generate(self, job: Job) -> AsyncGenerator[Chunk, None]: ...

    def load(self) -> tuple[int, int]:
        """(running, queued) generations, for metrics and Retry-After."""
        ...

    def abort_all(self) -> None:
        """Abort every generation now (drain deadline passed)."""
        ...

    def tokenize(self, job: Job) -> list[int]:
        """The prompt token ids `job` would run with (chat template applied); APIError where this
        backend cannot tell (an upstream tokenizes for itself)."""
        ...

    def detokenize(self, ids: list[int]) -> str: ...

    def context_length(self) -> int | None:
        """Tokens (prompt + output) one request may hold, when known."""
        ...

    def kv_cache(self) -> KVCacheUsage | None:
        """The target KV cache's slots, when this process holds it (an upstream reports its own)."""
        ...

    async def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache (SGLang's /flush_cache): (success, what was done)."""
        ...


__all__ = ["APIError", "Backend", "Chunk", "GenParams", "Job", "KVCacheUsage", "SpecStats"]
