"""SGLang's native `POST /generate` on the gateway, so clients written against an SGLang server (RL rollout
loops, `sglang.bench_serving --backend sglang`, `requests.post(url + "/generate", ...)`) run unchanged.

    {"text": str | [str], or "input_ids": [int] | [[int]],
     "sampling_params": {...} | [{...} per prompt], "stream": bool}
    -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", ...}}
       (a list of those for a batch or n > 1; a stream sends the text and ids so far in each event, then
       `data: [DONE]`, as SGLang 0.5.23 does by default; with "return_logprob": true, meta_info also has
       "output_token_logprobs" [[logprob, id, text or null], ...] and, with "top_logprobs_num": k,
       "output_top_logprobs": one list of k such triples per token; with "logprob_start_len": i >= 0 also the
       prompt's from position i, "input_token_logprobs" (the first prompt token's logprob null) and
       "input_top_logprobs")

The request becomes completion jobs (`schemas.completion_jobs`, raw prompt, no chat template), so limits,
validation and backends are the OpenAI routes'. Sampling parameters SGLang has and we do not (min_p,
stop_regex, structural_tag, beam search, ...) are a 400 naming them, not silently ignored.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from sglang_ext.grammar import GrammarSpec
from sglang_ext.sampling import MAX_TOP_LOGPROBS

from ..api.body import load_field, load_object
from ..api.errors import APIError, invalid
from ..backends.base import Chunk, Job
from .auth import tenant_key
from .generation import Choice, CompletionFormat, Generation
from .schemas import CompletionRequest, Limits, completion_jobs, parse

SGLANG_DEFAULT_MAX_NEW_TOKENS = (
    128  # SGLang's SamplingParams default (ours for the OpenAI routes is --default-max-tokens)
)

# SGLang sampling_params key -> our CompletionRequest field (the same meaning)
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "n": "n",
    "regex": "regex",
    "ebnf": "ebnf",
    "ignore_eos": "ignore_eos",
    "logit_bias": "logit_bias",
}
# keys accepted only at their default (what we always do), and keys without effect here
_ONLY_DEFAULT = {
    "min_p": 0.0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stop_regex": None,
    "structural_tag": None,
    "beam_width": None,
    "custom_params": None,
    "watermark": None,
}
_IGNORED = {"stream_interval"}  # how often SGLang streams; we stream each engine step
# top-level fields: accepted, or accepted only when off (null / false / empty)
_TOP_LEVEL = {
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "model",
    "return_logprob",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "logprob_start_len",
    "cache_salt",
}
_TOP_LEVEL_OFF = {
    "token_ids_logprob",
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "lora_path",
    "lora_id",
    "return_hidden_states",
    "session_params",
    "custom_logit_processor",
    "modalities",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
    "log_metrics",
    "return_routed_experts",
    "background",
    "priority",
}


@dataclass(frozen=True)
class Logprobs:
    """How a /generate request wants its logprobs reported (which tokens get them: the jobs' params)."""

    with_text: bool = False  # return_text_in_logprobs
    prompt_from: int | None = None  # logprob_start_len when prompt logprobs are asked


def generate_jobs(body: bytes, limits: Limits, api_key_id: str = "") -> tuple[list[Job], bool, bool, Logprobs]:
    """(jobs, whether the answer is a list, stream, how logprobs are reported) of a /generate body; api_key_id:
    the key it authenticated with, for the jobs' tenant (with its cache_salt)."""
    req = load_object(body)
    for key, value in req.items():
        if key in _TOP_LEVEL or (key in _TOP_LEVEL_OFF and value in (None, False, 0, [], {}, "")):
            continue
        what = "is not supported by this server" if key in _TOP_LEVEL_OFF else "is not a /generate field"
        raise APIError(400, f"{key} {what}", param=key, code="unsupported_parameter")
    logprobs, report = _logprob_options(req)
    prompts, batched = _prompts(req)
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream must be true or false", "stream")
    sp = req.get("sampling_params") or {}
    per_prompt = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(per_prompt) != len(prompts) or not all(isinstance(p, dict) for p in per_prompt):
        raise invalid(
            f"sampling_params must be an object, or a list of one object per prompt ({len(prompts)})", "sampling_params"
        )
    jobs: list[Job] = []
    salt = req.get("cache_salt")
    for g, (p, params) in enumerate(zip(prompts, per_prompt)):
        for job in _prompt_jobs(p, params, limits, stream, logprobs, salt):
            # /generate never echoes (max_new_tokens 0 borrows completions' echo-only path to pass validation)
            params_g = replace(
                job.params,
                echo=False,
                prompt_logprobs=report.prompt_from is not None,
                logprob_start_len=report.prompt_from,
            )
            tenant = tenant_key(api_key_id, salt)  # (salt checked by _prompt_jobs)
            jobs.append(replace(job, index=len(jobs), prompt_group=g, params=params_g, tenant=tenant))
    if len(jobs) > limits.max_n:
        raise invalid(
            f"at most {limits.max_n} generations per request (prompts x n), got {len(jobs)}", "sampling_params.n"
        )
    return jobs, batched or len(jobs) > 1, stream, report


def _logprob_options(req: dict) -> tuple[int | None, Logprobs]:
    """(the jobs' `logprobs`: None or the alternatives per token, how to report them)."""
    for key in ("return_logprob", "return_text_in_logprobs"):
        if not isinstance(req.get(key, False), bool):
            raise invalid(f"{key} must be true or false", key)
    top = req.get("top_logprobs_num") or 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs_num must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs_num")
    start = req.get("logprob_start_len")
    start = -1 if start is None else start
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise invalid(
            "logprob_start_len must be -1 (output tokens only) or a prompt position >= 0", "logprob_start_len"
        )
    if not req.get("return_logprob"):
        return None, Logprobs()
    return top, Logprobs(bool(req.get("return_text_in_logprobs")), start if start >= 0 else None)


def _prompts(req: dict) -> tuple[list, bool]:
    """(prompts: texts or id lists, whether the request is a batch)."""
    text, ids = req.get("text"), req.get("input_ids")
    if (text is None) == (ids is None):
        raise invalid("give either text or input_ids", "text")
    if text is not None:
        if isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text)):
            return ([text], False) if isinstance(text, str) else (text, True)
        raise invalid("text must be a string or a non-empty list of strings", "text")
    if _ids(ids):
        return [ids], False
    if isinstance(ids, list) and ids and all(_ids(x) for x in ids):
        return ids, True
    raise invalid("input_ids must be a list of token ids or a non-empty list of such lists", "input_ids")


def _ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompt_jobs(
    prompt, sp: dict[str, Any], limits: Limits, stream: bool, logprobs: int | None, cache_salt=None
) -> list[Job]:
    fields: dict[str, Any] = {
        "prompt": prompt,
        "stream": stream,
        "max_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS,
        "logprobs": logprobs,
        "cache_salt": cache_salt,  # (checked as on /v1/completions)
    }
    for key, value in sp.items():
        if key in _RENAMED:
            if value is not None:
                fields[_RENAMED[key]] = value
        elif key in _ONLY_DEFAULT:
            if value not in (None, [], "") and value != _ONLY_DEFAULT[key]:  # sglang.lang sends stop_regex: []
                raise APIError(
                    400,
                    f"sampling_params.{key}={value!r} is not supported by this server",
                    param=f"sampling_params.{key}",
                    code="unsupported_parameter",
                )
        elif key not in _IGNORED and key != "json_schema":
            raise invalid(f"sampling_params.{key} is not a sampling parameter", f"sampling_params.{key}")
    if fields["max_tokens"] == 0:
        # prefill only (SGLang clients send it to cache a prefix): completions allow 0 with echo (turned off after)
        fields["echo"] = True
    try:
        jobs = completion_jobs(parse(CompletionRequest, json.dumps(fields).encode()), limits)
    except APIError as e:
        raise _renamed(e, not isinstance(prompt, str)) from None
    schema = sp.get("json_schema")
    if schema is not None:
        _check_schema(schema)
        if jobs[0].params.grammar is not None:
            raise invalid(
                "json_schema cannot be combined with regex or ebnf: give one output constraint",
                "sampling_params.json_schema",
            )
        spec = GrammarSpec("json_schema", schema, "sampling_params.json_schema")
        jobs = [replace(j, params=replace(j.params, grammar=spec)) for j in jobs]
    return jobs


def _check_schema(schema) -> None:
    """SGLang's json_schema: a JSON schema as a string (parsed as a body is: depth-limited, text only)."""
    param = "sampling_params.json_schema"
    if not isinstance(schema, str):
        raise invalid(f"{param} must be a JSON schema as a string", param)
    load_field(schema, param, "it must be a JSON schema as a string")


_BACK = {ours: f"sampling_params.{theirs}" for theirs, ours in _RENAMED.items()} | {"prompt": "text"}


def _renamed(e: APIError, by_ids: bool = False) -> APIError:
    """An error about an OpenAI field, named as the /generate field it came from (by_ids: a prompt of input_ids)."""
    ours = next((k for k in _BACK if e.param and (e.param == k or e.param.startswith((k + "[", k + ".")))), None)
    if ours is None:
        return e
    param = ("input_ids" if ours == "prompt" and by_ids else _BACK[ours]) + e.param[len(ours) :]
    message = param + e.message[len(e.param) :] if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, param=param, code=e.code, headers=e.headers)


class NativeGeneration(Generation):
    """One /generate request: Generation's choices and lifecycle, SGLang's response shapes."""

    def __init__(self, backend, telemetry, jobs: list[Job], batched: bool, logprobs: Logprobs = Logprobs()):
        super().__init__(backend, telemetry, jobs, "", CompletionFormat, return_token_ids=True)
        self.batched, self.logprobs = batched, logprobs
        self.token_text = getattr(backend, "token_strings", None)  # id -> (text, bytes), for return_text_in_logprobs
        self.ids: dict[int, list[int]] = {c.job.index: [] for c in self.choices}
        self.lps: dict[int, list] = {c.job.index: [] for c in self.choices}  # TokenLogprobs so far
        self.prompt_lps: dict[int, list] = {c.job.index: [] for c in self.choices}

    async def open(self) -> None:
        try:
            await super().open()
        except APIError as e:  # the backend's checks name OpenAI fields: name the /generate ones
            raise _renamed(e, isinstance(self.choices[0].job.prompt, tuple)) from None

    def _observe(self, c: Choice, chunk: Chunk) -> None:
        super()._observe(c, chunk)
        self.ids[c.job.index] += chunk.ids or ()
        self.lps[c.job.index] += chunk.token_logprobs or ()
        self.prompt_lps[c.job.index] += chunk.prompt_token_logprobs or ()

    async def collect(self) -> dict | list:
        await self._run_to_end()
        outs = [self._out(c) for c in self.choices]
        return outs if self.batched else outs[0]

    # stream(): Generation's, with SGLang's events (each: the choice's text and ids so far)
    def _head(self):
        return ()

    def _tail(self):
        return ()

    def _chunk_events(self, c: Choice, chunk: Chunk):
        yield self._event(c)

    def _event(self, c: Choice) -> str:
        out = self._out(c)
        if self.batched:
            out["index"] = c.job.index
        return f"data: {json.dumps(out, ensure_ascii=False)}\n\n"

    def _out(self, c: Choice) -> dict:
        """The text and ids so far, with SGLang's meta_info (its finish_reason object once finished)."""
        final = c.final
        ids = final.token_ids if final is not None and final.token_ids is not None else self.ids[c.job.index]
        text = "".join(c.parts)
        meta: dict[str, Any] = {
            "id": f"{self.id}-{c.job.index}",
            "finish_reason": None,
            "prompt_tokens": None,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
        }
        if final is not None:
            meta["finish_reason"] = (
                {"type": final.finish_reason, "length": final.completion_tokens or 0}
                if final.finish_reason == "length"
                else {"type": final.finish_reason, "matched": None}
            )
            meta["prompt_tokens"] = final.prompt_tokens
            meta["cached_tokens"] = final.cached_tokens or 0
            meta["completion_tokens"] = final.completion_tokens if final.completion_tokens is not None else len(ids)
            meta["e2e_latency"] = round(time.monotonic() - self.t0, 6)
            if final.spec is not None and final.spec.verify_steps:
                meta |= final.spec.as_meta_info()
                meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"] = (
                    final.spec.accepted_tokens,
                    final.spec.draft_tokens,
                )
        k = c.job.params.logprobs
        if k is not None:
            lps, prompt = self.lps[c.job.index], self.prompt_lps[c.job.index][self.logprobs.prompt_from or 0 :]
            meta["input_token_logprobs"] = [
                self._triple(x.logprob, x.token) for x in prompt
            ]  # [] for logprob_start_len -1
            meta["output_token_logprobs"] = [self._triple(x.logprob, x.token) for x in lps]
            if k:
                meta["input_top_logprobs"] = [
                    None if x.logprob is None else [self._triple(lp, t) for t, lp in x.top] for x in prompt
                ]
                meta["output_top_logprobs"] = [[self._triple(lp, t) for t, lp in x.top] for x in lps]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    def _triple(self, logprob: float, token: int) -> list:
        """SGLang's (logprob, token id, text or None)."""
        return [logprob, token, self.token_text(token)[0] if self.logprobs.with_text and self.token_text else None]


# --- what SGLang clients ask a server about itself (sglang.lang's RuntimeEndpoint calls /get_model_info) ----
def model_info(backend) -> dict:
    return {
        "model_path": backend.model_ids[0],
        "tokenizer_path": backend.model_ids[0],
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def server_info(backend, telemetry, version: str) -> dict:
    """A few of SGLang's /server_info fields, from our counters: the mean acceptance length since start."""
    steps, accepted = telemetry.spec_counts()
    kv = backend.kv_cache()
    return {
        "version": f"moa-serve {version}",
        "model_path": backend.model_ids[0],
        "backend": backend.kind,
        "speculative_algorithm": backend.drafter,
        "max_total_num_tokens": kv.capacity if kv else None,
        "internal_states": [{"avg_spec_accept_length": (accepted + steps) / steps if steps else None}],
    }
