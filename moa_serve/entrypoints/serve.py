"""`moa-serve serve`: flags -> ServeOptions -> serving/gateway/server.py's build_gateway (a backend, the
embedded engine or an upstream SGLang server, behind the gateway app) -> uvicorn with a graceful drain.

The parser needs only the core package (every subcommand's --help builds it); the gateway, which needs the
`serve` extra (fastapi, uvicorn, ...), is imported when the command runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moa_serve.entrypoints.flags import add_model_args, add_spec_args, engine_config
from serving.gateway.settings import BACKENDS, gateway_settings

if TYPE_CHECKING:
    from serving.gateway.server import ServeOptions
    from serving.grammar_pool import GrammarConfig


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run the OpenAI-compatible gateway (embedded engine or upstream SGLang)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    add_model_args(s)
    add_spec_args(s)
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` name clients use (default: --model, or the directory name for a path)",
    )
    _add_backend_args(s)
    _add_engine_args(s)
    _add_limit_args(s)
    _add_server_args(s)


def _add_backend_args(s) -> None:
    s.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="embedded engine (default) or an upstream SGLang server [env MOA_SERVE_BACKEND]",
    )
    s.add_argument(
        "--upstream",
        default=None,
        help="upstream base URL for --backend sglang, e.g. http://sglang:30000 [env MOA_SERVE_UPSTREAM]",
    )
    s.add_argument(
        "--upstream-model",
        default=None,
        help="model name sent upstream (default: the first id of the upstream's /v1/models)",
    )
    s.add_argument("--upstream-timeout", type=float, default=600.0, help="seconds without upstream bytes before 504")


def _add_engine_args(s) -> None:
    """The embedded engine's settings (build_embedded passes them to engine_config) and its edge API."""
    from serving.config import PREFILL_MODES

    s.add_argument(
        "--no-adaptive",
        action="store_true",
        help=(
            "embedded: always speculate with --tree (default: per step, the measured-fastest of off / --tree / a "
            "smaller tree)"
        ),
    )
    s.add_argument("--kv-slots", type=int, default=16384, help="embedded: target KV pool size in tokens")
    s.add_argument(
        "--prefill-tokens",
        type=int,
        default=512,
        help=(
            "embedded: prompt tokens prefilled per step at most; longer prompts are prefilled in chunks over several "
            "steps, next to the running requests' decode steps"
        ),
    )
    s.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default="first",
        help=(
            "embedded: how arrivals' prompts share steps with the running requests: first (a step of their own, "
            "at most one step in two, so a new request's first token does not wait for everyone's trees: the "
            "lowest time to first token under load), mixed (in the running requests' forward: the most tokens "
            "per second), separate (their own forward in the same step)"
        ),
    )
    s.add_argument("--max-context", type=int, default=None, help="embedded: context limit (default: the model's)")
    s.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "embedded: reuse the KV of prompt prefixes earlier requests of the same tenant (API key, cache_salt) "
            "computed, evicted least recently used first when the KV pool needs room (default: on)"
        ),
    )
    s.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        help="embedded: most tokens the prefix cache keeps (default: as many as the KV pool has room for)",
    )
    s.add_argument(
        "--edge-drafters",
        default=None,
        help=(
            "embedded: comma list of drafters (e.g. moa-tli1,moa-tli0,eagle3) whose clients may use the edge session "
            "API /v1/edge/sessions"
        ),
    )
    s.add_argument("--edge-ttl", type=float, default=120.0, help="seconds an idle edge session keeps its KV")


def _add_limit_args(s) -> None:
    s.add_argument(
        "--max-running",
        type=int,
        default=64,
        help=(
            "requests decoded together (continuous batching; sglang: upstream requests at once); a tenant running "
            "fewer than its share of them is let in beyond it"
        ),
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for admission; when full, the tenant with the longest queue for its weight gets the 429",
    )
    s.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens a request may ask for")
    s.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        help=(
            "embedded: max_tokens when a request sets none (KV is reserved for prompt + max_tokens); sglang: the "
            "admission cost of such a request"
        ),
    )
    s.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="embedded: longest prompt accepted (default: the context)"
    )
    s.add_argument("--max-n", type=int, default=16, help="most choices per request (n x prompts)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 above)")
    s.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's head (else the connection is closed), then its body (else 408)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        help="open connections at most; a request beyond them gets a 503 and its connection is closed",
    )
    s.add_argument(
        "--grammar-workers",
        type=int,
        default=2,
        help="processes compiling structured-output grammars (and checking tool schemas), one request at a time each",
    )
    s.add_argument(
        "--grammar-timeout",
        type=float,
        default=10.0,
        help="seconds one request's grammar may take to compile; beyond it the compile is stopped (400)",
    )


def _add_server_args(s) -> None:
    s.add_argument(
        "--api-keys-file",
        default=None,
        help=(
            "file with one API key per line, optionally naming its tenant, weight and limits ('sk-... tenant=team-a "
            "weight=2 max_running=8 max_queued=16 tokens_per_minute=100000') [env MOA_SERVE_API_KEYS_FILE; keys "
            "also from env MOA_SERVE_API_KEYS, comma list]"
        ),
    )
    s.add_argument(
        "--auth-exempt",
        default=None,
        help="comma list of paths served without an API key ('' = none; default: /health, /ready, /metrics)",
    )
    s.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM"
    )
    s.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: OMP_NUM_THREADS or torch's default)"
    )
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--no-access-log", action="store_true")


def _served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).name if os.sep in args.model else args.model


def _grammar_config(args) -> GrammarConfig:
    from serving.grammar_pool import GrammarConfig

    return GrammarConfig(workers=args.grammar_workers, timeout_s=args.grammar_timeout)


def serve_options(args) -> ServeOptions:
    """The flags (and their MOA_SERVE_* defaults) as one ServeOptions; a bad combination is a ValueError."""
    from serving.backends.base import Admission
    from serving.backends.embedded import EmbeddedLimits
    from serving.backends.sglang import UpstreamConfig
    from serving.gateway.app import DEFAULT_AUTH_EXEMPT, GatewayConfig
    from serving.gateway.auth import APIKeys
    from serving.gateway.schemas import Limits
    from serving.gateway.server import ServeOptions

    backend = args.backend or gateway_settings().backend or "embedded"  # (each source checked against BACKENDS)
    upstream = args.upstream or gateway_settings().upstream
    if backend == "sglang" and not upstream:
        raise ValueError("--backend sglang needs --upstream URL (or MOA_SERVE_UPSTREAM)")
    keys = APIKeys.from_env(args.api_keys_file)
    gateway = GatewayConfig(
        limits=Limits(
            max_n=args.max_n,
            max_tokens=args.max_tokens_limit,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout,
            max_connections=args.max_connections,
        ),
        api_keys=keys if keys.enabled else None,
        auth_exempt=DEFAULT_AUTH_EXEMPT
        if args.auth_exempt is None
        else tuple(p for p in args.auth_exempt.split(",") if p),
    )
    common = dict(
        served_name=_served_name(args),
        gateway=gateway,
        admission=Admission(args.max_running, args.max_queue),
        edge_drafters=args.edge_drafters,
        edge_ttl_s=args.edge_ttl,
    )
    if backend == "sglang":
        # the upstream drafts: the label says so unless --drafter names it
        label = "upstream" if args.drafter == "auto" else args.drafter or "none"
        upstream_cfg = UpstreamConfig(
            upstream,
            args.upstream_model,
            timeout_s=args.upstream_timeout,
            api_key=gateway_settings().upstream_api_key,
            grammar=_grammar_config(args),
            default_max_tokens=args.default_max_tokens,
        )
        return ServeOptions(upstream=upstream_cfg, drafter_label=label, **common)
    engine = engine_config(
        args,
        kv_slots=args.kv_slots,
        max_context=args.max_context,
        adaptive=not args.no_adaptive,
        prefill_tokens=args.prefill_tokens,
        prefill=args.prefill,
        prefix_cache=args.prefix_cache,
        prefix_cache_tokens=args.prefix_cache_tokens,
    )  # a bad --tree fails here, before the model loads
    limits = EmbeddedLimits(
        default_max_tokens=args.default_max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        grammar=_grammar_config(args),
    )
    return ServeOptions(engine=engine, embedded=limits, **common)


def cmd_serve(args) -> int:
    from serving.gateway.server import DrainingServer, build_gateway, uvicorn_config

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = serve_options(args)
    app, backend = build_gateway(options)
    keys = options.gateway.api_keys
    print(
        f"moa-serve: {options.backend} backend, model {backend.model_ids[0]!r}, drafter {backend.drafter!r}, "
        f"API keys {'on' if keys else 'off'}, http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    cfg = uvicorn_config(app, args.host, args.port, log_level=args.log_level, access_log=not args.no_access_log)
    DrainingServer(cfg, app.state.gateway, backend, args.drain_timeout).run()
    return 0
