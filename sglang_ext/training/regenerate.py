"""The target's answers from a running server (ours, SGLang, vLLM, any OpenAI-compatible one): what
`moa-serve distill --base-url` sends its prompts to.

Two APIs, tried in this order (RemoteConfig.api "auto"; a 404 on the first moves to the second):

    POST /generate              SGLang's native API (our gateway has it too): the chat-templated prompt's
                                token ids in, the answer's token ids out, exactly as the target sampled them
    POST /v1/chat/completions   the messages in, text out: the answer is re-tokenized with the target's
                                tokenizer and chat template (Answer.retokenized)

Failures that may pass (a refused or dropped connection, a timeout, 5xx, 408, 429) are retried with
exponential backoff; a prompt that still fails after `max_retries` retries stops the run (ServerError:
nothing is dropped, and `--resume` continues). Other 4xx answers refuse that one prompt
(Answer.refused holds the server's message): reported, never silently left out.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ServerError(RuntimeError):
    """The server kept failing (unreachable, dropping connections or answering 5xx) past the retries."""


@dataclass(frozen=True)
class RemoteConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)
    api_key: str | None = None
    model: str | None = None  # the model name for /v1/chat/completions (default: the first of GET /v1/models)
    api: str = "auto"  # auto | generate | chat
    concurrency: int = 8  # requests in flight
    max_retries: int = 6
    backoff_s: float = 1.0  # the first retry's wait; doubled each retry, at most 60 s
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.api not in ("auto", "generate", "chat"):
            raise ValueError(f"api must be auto, generate or chat, got {self.api!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")


class Prompt(Protocol):
    """What a server is asked (a dialogues.Turn)."""

    id: str
    messages: list[dict]  # [{"role", "content"}], ending with the user turn
    prompt_ids: list[int]  # the chat template's rendering, ending with the assistant header
    seed: int | None  # its sampling seed (None: the run's)


@dataclass
class Answer:
    prompt: Prompt
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # stop | length
    retokenized: bool = False  # the server returned text only
    refused: str | None = None  # the server's 4xx message: this prompt has no answer
    retries: int = 0


class _Retry(Exception):
    """A failure worth another try."""


class RemoteTarget:
    """Answers prompts through a server, one thread per request in flight (httpx is thread-safe)."""

    def __init__(self, cfg: RemoteConfig, params: dict, tokenizer, sleep: Callable[[float], None] = time.sleep):
        """params: max_new_tokens, temperature, top_p, seed (the run's sampling)."""
        import httpx

        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.cfg, self.params, self.tokenizer, self.sleep = cfg, params, tokenizer, sleep
        self.client = httpx.Client(
            base_url=cfg.root,
            headers=headers,
            timeout=cfg.timeout_s,
            limits=httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency),
        )
        self.api = cfg.api
        self._lock = threading.Lock()
        self._model = cfg.model

    def close(self) -> None:
        self.client.close()

    def answer(self, prompt: Prompt) -> Answer:
        """The server's answer to one prompt, retried through passing failures (ServerError past them)."""
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                self.sleep(min(60.0, self.cfg.backoff_s * 2 ** (attempt - 1)))
            try:
                ans = self._once(prompt)
                ans.retries = attempt
                return ans
            except _Retry as e:
                last = str(e)
        raise ServerError(f"{self.cfg.root}: prompt {prompt.id} failed {self.cfg.max_retries + 1} times; last: {last}")

    def _once(self, prompt: Prompt) -> Answer:
        if self.api in ("auto", "generate"):
            ans = self._generate(prompt)
            if ans is not None:
                return ans
            with self._lock:  # no /generate here: every later prompt goes to chat
                self.api = "chat"
        return self._chat(prompt)

    def _post(self, path: str, body: dict):
        """(status, JSON body) of a POST; _Retry for the failures that may pass."""
        import httpx

        try:
            r = self.client.post(path, json=body)
        except httpx.TransportError as e:  # refused, reset, dropped mid-answer, timed out
            raise _Retry(f"POST {path}: {type(e).__name__}: {e}") from None
        if r.status_code in RETRY_STATUS:
            raise _Retry(f"POST {path}: HTTP {r.status_code}: {r.text[:200]}")
        try:
            return r.status_code, r.json()
        except ValueError:
            if r.status_code == 200:  # a 200 whose body is cut or garbled: the answer was lost on the way
                raise _Retry(f"POST {path}: HTTP 200 with a body that is not JSON: {r.text[:100]!r}") from None
            return r.status_code, {"error": {"message": r.text[:300]}}

    def _generate(self, prompt: Prompt) -> Answer | None:
        p = self.params
        sp = {"max_new_tokens": p["max_new_tokens"], "temperature": p["temperature"], "top_p": p["top_p"]}
        seed = _seed(prompt, p)
        if p["temperature"] > 0 and seed is not None:
            sp["sampling_seed"] = seed
        status, body = self._post("/generate", {"input_ids": prompt.prompt_ids, "sampling_params": sp})
        if status == 404 and self.api == "auto":
            return None
        if status != 200:
            return Answer(prompt, refused=f"HTTP {status}: {_message(body)}")
        reason = body["meta_info"]["finish_reason"]
        reason = reason.get("type") if isinstance(reason, dict) else reason
        return Answer(prompt, list(body["output_ids"]), body.get("text", ""), _finish(reason))

    def _chat(self, prompt: Prompt) -> Answer:
        p = self.params
        body = {
            "model": self.model(),
            "messages": prompt.messages,
            "max_tokens": p["max_new_tokens"],
            "temperature": p["temperature"],
            "top_p": p["top_p"],
        }
        seed = _seed(prompt, p)
        if p["temperature"] > 0 and seed is not None:
            body["seed"] = seed
        status, out = self._post("/v1/chat/completions", body)
        if status != 200:
            return Answer(prompt, refused=f"HTTP {status}: {_message(out)}")
        choice = out["choices"][0]
        text, reason = choice["message"].get("content") or "", _finish(choice.get("finish_reason"))
        if choice.get("token_ids") is not None:
            return Answer(prompt, list(choice["token_ids"]), text, reason)
        ids = retokenize(self.tokenizer, prompt, text, reason)
        return Answer(prompt, ids, text, reason, retokenized=True)

    def model(self) -> str:
        """--model-name, else the first model the server lists."""
        with self._lock:
            if self._model is None:
                import httpx

                try:
                    r = self.client.get("/v1/models")
                    r.raise_for_status()
                    self._model = r.json()["data"][0]["id"]
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                    raise ServerError(f"{self.cfg.root}: cannot list its models ({e}); pass the model name") from None
            return self._model


def _seed(prompt, params: dict) -> int | None:
    """The prompt's own seed (a dialogue's sample), else the run's."""
    seed = getattr(prompt, "seed", None)
    return params.get("seed") if seed is None else seed


def _message(body) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err or body
    return str(msg)[:300]


def _finish(reason) -> str:
    return "length" if reason == "length" else "stop"


def retokenize(tokenizer, prompt: Prompt, text: str, finish_reason: str) -> list[int]:
    """The answer's token ids after the prompt's as the chat template renders the whole exchange (a
    finished answer ends with the template's end of turn; a cut one with its last token)."""
    messages = prompt.messages + [{"role": "assistant", "content": text}]
    if finish_reason == "stop":
        full = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        full = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True) + text
    ids = tokenizer.encode(full, add_special_tokens=False)
    if ids[: len(prompt.prompt_ids)] != prompt.prompt_ids:
        raise ValueError("the chat template does not render the answer after the prompt's tokens; cannot re-tokenize")
    return ids[len(prompt.prompt_ids) :]


def regenerate(remote: RemoteTarget, queue) -> Iterator[Answer]:
    """Answers (refused ones included) as they finish, `concurrency` requests in flight. queue.pop() gives
    the next prompt (a dialogues.Turn; None: none ready yet); the caller reports each answer back
    (queue.answered) before taking the next, so a dialogue's following turn can start. A ServerError
    stops new requests, lets the ones in flight finish (their answers are still yielded) and is raised
    after them."""
    failure = None
    with ThreadPoolExecutor(remote.cfg.concurrency, thread_name_prefix="regenerate") as pool:
        running = set()
        while True:
            while failure is None and len(running) < remote.cfg.concurrency and (p := queue.pop()) is not None:
                running.add(pool.submit(remote.answer, p))
            if not running:
                break
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    ans = f.result()
                except ServerError as e:
                    failure = failure or e
                    continue
                yield ans
    if failure is not None:
        raise failure
