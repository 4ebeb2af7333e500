"""`moa-serve edge` (one generation from an edge client: draft here, verify on a moa-serve server)
and `moa-serve edge-bench` (moa_serve/benchmarks/edge.py)."""

from __future__ import annotations

import sys
import time

from moa_serve.benchmarks.edge import EdgeBenchSettings, edge_table, run_edge_bench
from moa_serve.entrypoints.flags import (
    add_generation_args,
    add_model_args,
    add_spec_args,
    engine_config,
    generation_json,
    sampling_params,
)
from serving.gateway.settings import gateway_settings

WIRE_DTYPES = ["fp32", "bf16", "fp16", "int8"]
# the sampling flags of each SamplingParams field the edge protocol cannot honour
_FLAGS = {
    "temperature": "--temperature > 0",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "repetition_penalty": "--repetition-penalty",
    "min_tokens": "--min-tokens",
    "grammar": "--regex / --json-schema",
}


def add_edge_parsers(sub) -> None:
    e = sub.add_parser(
        "edge", help="generate on an edge client: draft here, verify on a moa-serve server (--edge-drafters)"
    )
    e.add_argument("--server", required=True, help="base URL of a `moa-serve serve --edge-drafters ...` server")
    e.add_argument("--prompt", required=True)
    add_model_args(
        e, model_help="the local copy of the target (its embeddings, norm, head and last TLI layers are used)"
    )
    add_spec_args(
        e, drafter="moa-tli1", drafter_help="a drafter the server offers: moa-tli0 | moa-tli1 | moa | eagle3 | PATH"
    )
    add_generation_args(e)
    e.add_argument("--wire-dtype", default="fp16", choices=WIRE_DTYPES, help="dtype of the context the server sends")
    e.add_argument("--timeout", type=float, default=2.0, help="seconds before a call counts as disconnected")
    e.add_argument(
        "--resync",
        default="verify",
        choices=["verify", "keep"],
        help="offline tokens on reconnect: verified and replaced from the first disagreement, or kept",
    )
    e.add_argument("--api-key", default=None, help="API key of the server [env MOA_SERVE_API_KEY]")
    e.set_defaults(handler=cmd_edge)
    _add_edge_bench_parser(sub)


def _add_edge_bench_parser(sub) -> None:
    d = EdgeBenchSettings()
    b = sub.add_parser(
        "edge-bench", help="client–server decoding over emulated 5G/4G links (needs root for network namespaces)"
    )
    b.add_argument("--profiles", default=d.profiles, help="comma list of lan,5g,4g")
    b.add_argument("--drafters", default=d.drafters)
    b.add_argument("--server-drafter", default=d.server_drafter, help="the server's own drafter for the API baseline")
    b.add_argument("--sets", default=d.sets)
    b.add_argument("--prompts", type=int, default=d.prompts, help="prompts per set")
    b.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    b.add_argument("--wire-dtype", default=d.wire_dtype, choices=WIRE_DTYPES)
    b.add_argument("--also-int8", action="store_true", help="add rows with int8 context to measure its effect on τ")
    b.add_argument(
        "--trees",
        default=d.trees,
        help=(
            "';'-separated tree shapes to compare per drafter (e.g. '3,4,16;1,2,3'); default: the drafter's default "
            "tree"
        ),
    )
    b.add_argument("--cut", action="store_true", help="add the disconnect run (link cut after 50 tokens)")
    b.add_argument("--threads", type=int, default=d.threads, help="torch threads for the client and for the server")
    b.add_argument("--out", default=d.out)
    b.set_defaults(handler=cmd_edge_bench)


def cmd_edge_bench(args) -> int:
    fields = EdgeBenchSettings.__dataclass_fields__
    rows = run_edge_bench(EdgeBenchSettings(**{k: v for k, v in vars(args).items() if k in fields}))
    print(edge_table(rows))
    return 0


def cmd_edge(args) -> int:
    from serving.edge.client import EdgeClient, local_drafter
    from sglang_ext.drafters import default_tree
    from sglang_ext.models import load_target

    params = _edge_params(args)
    config = engine_config(args)  # a bad --tree / --device fails before the model loads
    tree = config.tree or default_tree(config.drafter)
    target = load_target(config.model, dtype=config.dtype, device=config.device)
    client = EdgeClient(
        args.server,
        local_drafter(target, config.drafter),
        config.drafter,
        tree,
        args.wire_dtype,
        args.api_key or gateway_settings().api_key,
        args.timeout,
        args.resync,
        eos_ids=tuple(target.cfg.eos_token_ids),
    )
    ids = target.encode_chat([{"role": "user", "content": args.prompt}])
    try:
        if args.json:
            _print_json(client, target, ids, params.max_new_tokens, config.drafter, tree)
        else:
            _stream(client, target, ids, params.max_new_tokens)
    finally:
        client.close()
    return 0


def _edge_params(args):
    """sampling_params(args), refusing (ValueError: exit code 2) what the edge protocol would ignore."""
    from serving.edge.client import unsupported_settings

    params = sampling_params(args)
    bad = unsupported_settings(params)
    if bad:
        raise ValueError(
            "the edge API verifies greedily and stops only at end of text or --max-new-tokens; it cannot apply "
            + ", ".join(_FLAGS.get(b, b) for b in bad)
        )
    return params


def _stream(client, target, ids: list[int], max_new_tokens: int) -> None:
    """Print tokens as they come: verified ones plain, unverified (offline) drafts dimmed; stats on stderr."""
    pending: list[int] = []
    dim, reset = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("[", "]")
    for ev in client.generate(ids, max_new_tokens):
        if ev.kind == "token":
            print(target.decode(ev.tokens), end="", flush=True)
        elif ev.kind == "draft":
            pending += ev.tokens
            print(f"{dim}{target.decode(ev.tokens)}{reset}", end="", flush=True)  # unverified
        elif ev.kind == "confirm":
            pending = pending[ev.count :]
        elif ev.kind == "retract":
            print(f"{dim}<-{ev.count} replaced>{reset}", end="", flush=True)
            pending = []
    print()
    st = client.stats
    print(
        f"[{st.cycles} cycles, τ {st.accept_length:.2f}, {st.calls} calls, "
        f"{sum(st.cycle_bytes) / max(1, len(st.cycle_bytes)):.0f} B/cycle, "
        f"{st.disconnects} disconnects, {st.offline_tokens} offline tokens ({st.offline_kept} kept)]",
        file=sys.stderr,
    )


def _print_json(client, target, ids: list[int], max_new_tokens: int, drafter: str, tree) -> None:
    """One JSON object as `generate --json` prints, plus the edge link's counters."""
    from serving.edge.client import collect

    t0 = time.perf_counter()
    verified, pending = collect(client.generate(ids, max_new_tokens))
    dt = time.perf_counter() - t0
    out, st = verified + pending, client.stats
    stats = {
        "accept_length": round(st.accept_length, 4),
        "draft_tokens_per_step": round(st.drafted / max(st.cycles, 1), 4),
        "verify_steps": st.cycles,
        "tokens_per_s": round(len(out) / dt, 3),
        "unverified_tokens": len(pending),  # drafted offline and never verified (the link stayed down)
        "server_calls": st.calls,
        "disconnects": st.disconnects,
    }
    finish = "stop" if out and out[-1] in client.eos_ids else "length"
    print(generation_json(target.decode(out), out, finish, stats, drafter, tree))
