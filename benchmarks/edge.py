"""`moa-serve edge` (one generation from an edge client) and `moa-serve edge-bench`.

edge-bench puts the server on its own host (a network namespace joined by a veth pair, tbf for
the bandwidth) and the client here behind a LinkProxy with the profile's delay/jitter/loss
(netem.py says why), then runs, per profile and prompt, interleaved:

    edge:<drafter>   this process drafts (MoA TLI 0/1, EAGLE-3), one server call per cycle
    api              the same prompt streamed from the server's /v1/chat/completions over the same link

and reports tokens/s, server calls per generated token, bytes per cycle, τ. A "cut" run drops the
link after 50 tokens for a few seconds and reports the offline tokens and their agreement with
the connected output. Client and server share this machine's cores: say so when reading numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sglang_ext.settings import settings


def add_edge_parsers(sub) -> None:
    e = sub.add_parser(
        "edge", help="generate on an edge client: draft here, verify on a moa-serve server (--edge-drafters)"
    )
    e.add_argument("--server", required=True, help="base URL of a `moa-serve serve --edge-drafters ...` server")
    e.add_argument("--prompt", required=True)
    e.add_argument(
        "--drafter", default="moa-tli1", help="a drafter the server offers: moa-tli0 | moa-tli1 | moa | eagle3 | PATH"
    )
    e.add_argument(
        "--model",
        default="smollm2",
        help="the local copy of the target (its embeddings, norm, head and last TLI layers are used)",
    )
    e.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    e.add_argument(
        "--wire-dtype",
        default="fp16",
        choices=["fp32", "bf16", "fp16", "int8"],
        help="dtype of the context the server sends",
    )
    e.add_argument("--tree", default=None)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--timeout", type=float, default=2.0, help="seconds before a call counts as disconnected")
    e.add_argument(
        "--resync",
        default="verify",
        choices=["verify", "keep"],
        help="offline tokens on reconnect: verified and replaced from the first disagreement, or kept",
    )
    e.add_argument("--api-key", default=settings().api_key)
    e.set_defaults(handler=cmd_edge)

    b = sub.add_parser(
        "edge-bench", help="client–server decoding over emulated 5G/4G links (needs root for network namespaces)"
    )
    b.add_argument("--profiles", default="5g,4g", help="comma list of lan,5g,4g")
    b.add_argument("--drafters", default="moa-tli0,moa-tli1,eagle3")
    b.add_argument("--server-drafter", default="none", help="the server's own drafter for the API baseline")
    b.add_argument("--sets", default="humaneval,mt_bench")
    b.add_argument("--prompts", type=int, default=3, help="prompts per set")
    b.add_argument("--max-new-tokens", type=int, default=96)
    b.add_argument("--wire-dtype", default="fp16", choices=["fp32", "bf16", "fp16", "int8"])
    b.add_argument("--also-int8", action="store_true", help="add rows with int8 context to measure its effect on τ")
    b.add_argument(
        "--trees",
        default="",
        help=(
            "';'-separated tree shapes to compare per drafter (e.g. '3,4,16;1,2,3'); default: the drafter's default "
            "tree"
        ),
    )
    b.add_argument("--cut", action="store_true", help="add the disconnect run (link cut after 50 tokens)")
    b.add_argument("--threads", type=int, default=1, help="torch threads for the client and for the server")
    b.add_argument("--out", default="results/edge")
    b.set_defaults(handler=cmd_edge_bench)


def _local_drafter(target, name: str):
    from sglang_ext.drafters import make_drafter
    from sglang_ext.drafters.moa import MoADrafter

    d = make_drafter(name, target)
    if isinstance(d, MoADrafter):  # the client keeps its own copy of the TLI layers' K/V
        d = MoADrafter(target.model, d.draft, name=d.name, remote=True)
    return d


def cmd_edge(args) -> int:
    from serving.edge.client import EdgeClient
    from sglang_ext.drafters import default_tree
    from sglang_ext.models import load_target
    from sglang_ext.tree import TreeShape

    target = load_target(args.model, dtype=args.dtype)
    tree = TreeShape.parse(args.tree) if args.tree else default_tree(args.drafter)
    client = EdgeClient(
        args.server,
        _local_drafter(target, args.drafter),
        args.drafter,
        tree,
        args.wire_dtype,
        args.api_key,
        args.timeout,
        args.resync,
        eos_ids=tuple(target.cfg.eos_token_ids),
    )
    ids = target.encode_chat([{"role": "user", "content": args.prompt}])
    pending: list[int] = []
    dim, reset = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("[", "]")
    for ev in client.generate(ids, args.max_new_tokens):
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
    client.close()
    return 0


# --- benchmark ----------------------------------------------------------------------------------
def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become ready")


def _api_run(url: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion; tokens/s over the whole request (as a user sees it)."""
    t0 = time.perf_counter()
    n, first = 0, None
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            elif first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "ttft_s": first, "calls_per_token": 1 / max(n, 1)}


def _edge_run(
    client, ids: list[int], max_tokens: int, cut_after: int | None = None, link=None, cut_seconds: float = 3.0
) -> dict:
    import threading

    from serving.edge.client import EdgeStats, collect

    timer = None

    def cut_once_after(events):
        """Pass events through; after cut_after tokens, take the link down for cut_seconds."""
        nonlocal timer
        produced = 0
        for ev in events:
            produced += len(ev.tokens)
            if cut_after is not None and timer is None and produced >= cut_after:
                link.cut()
                timer = threading.Timer(cut_seconds, link.restore)  # the link comes back on its own clock
                timer.start()
            yield ev

    client.stats = EdgeStats()
    t0 = time.perf_counter()
    verified, _ = collect(cut_once_after(client.generate(ids, max_tokens)))
    if timer is not None:
        timer.cancel()
        link.restore()
    dt = time.perf_counter() - t0
    st = client.stats
    return {
        "tokens": len(verified),
        "seconds": dt,
        "tokens_per_s": len(verified) / dt,
        "tau": st.accept_length,
        "calls": st.calls,
        "calls_per_token": st.calls / max(1, len(verified)),
        "bytes_per_cycle": sum(st.cycle_bytes) / max(1, len(st.cycle_bytes)),
        "offline_tokens": st.offline_tokens,
        "offline_kept": st.offline_kept,
        "output": verified,
    }


def cmd_edge_bench(args) -> int:
    import torch

    from benchmarks.netem import PROFILES, LinkProxy, NamespaceHost, namespaces_available
    from serving.edge.client import EdgeClient
    from sglang_ext.drafters import default_tree
    from sglang_ext.evalsets import load_eval_set
    from sglang_ext.models import load_target
    from sglang_ext.tree import TreeShape

    reason = namespaces_available()
    if reason:
        raise RuntimeError(f"edge-bench {reason}")
    torch.set_num_threads(args.threads)
    profiles = [PROFILES[p] for p in args.profiles.split(",")]
    drafters = [d for d in args.drafters.split(",") if d]
    target = load_target("smollm2", dtype="auto")
    local = {d: _local_drafter(target, d) for d in drafters}
    prompts = []
    for s in args.sets.split(","):
        _, texts = load_eval_set(s, args.prompts)
        prompts += [(s, t) for t in texts]
    rows, out = [], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wire = [args.wire_dtype] + (["int8"] if args.also_int8 and args.wire_dtype != "int8" else [])
    # parsed here: bad input fails before the namespaces are set up
    trees = {t.strip(): TreeShape.parse(t) for t in args.trees.split(";") if t.strip()}
    for prof in profiles:
        with NamespaceHost(1, prof.rate_mbit) as host:
            cmd = [
                sys.executable,
                "-m",
                "entrypoints.cli",
                "serve",
                "--host",
                host.ns_ip,
                "--port",
                "8000",
                "--drafter",
                args.server_drafter,
                "--edge-drafters",
                ",".join(drafters),
                "--threads",
                str(args.threads),
                "--log-level",
                "warning",
                "--no-access-log",
            ]
            server = host.popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out / f"server-{prof.name}.log", "w"))
            try:
                with LinkProxy(host.ns_ip, 8000, prof, seed=0) as link:
                    _wait_ready(link.url, server)
                    for set_name, text in prompts:
                        ids = target.encode_chat([{"role": "user", "content": text}])
                        rows.append(
                            {
                                "profile": prof.name,
                                "set": set_name,
                                "method": "api",
                                **_api_run(link.url, text, args.max_new_tokens),
                            }
                        )
                        for d, w, tree in [(d, w, t) for d in drafters for w in wire for t in (trees or [None])]:
                            method = (
                                f"edge:{d}" + ("" if w == args.wire_dtype else f":{w}") + (f"@{tree}" if tree else "")
                            )
                            shape = trees[tree] if tree else default_tree(d)
                            c = EdgeClient(
                                link.url, local[d], d, shape, w, timeout_s=2.0, eos_ids=tuple(target.cfg.eos_token_ids)
                            )
                            try:
                                r = _edge_run(c, ids, args.max_new_tokens)
                            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                                rows.append(
                                    {
                                        "profile": prof.name,
                                        "set": set_name,
                                        "method": method,
                                        "error": f"{type(e).__name__}: {e}",
                                    }
                                )
                                continue
                            finally:
                                c.close()
                            rows.append({"profile": prof.name, "set": set_name, "method": method, **r})
                            print(
                                f"[edge-bench] {prof.name} {set_name} {rows[-1]['method']}: {r['tokens_per_s']:.1f} "
                                f"tok/s τ {r['tau']:.2f}",
                                file=sys.stderr,
                                flush=True,
                            )
                    if args.cut:
                        for d in [x for x in drafters if x.startswith("moa")]:
                            _, text = prompts[0]
                            ids = target.encode_chat([{"role": "user", "content": text}])
                            c = EdgeClient(
                                link.url, local[d], d, default_tree(d), args.wire_dtype, timeout_s=1.0, eos_ids=()
                            )
                            try:
                                ref = _edge_run(c, ids, 120)
                                r = _edge_run(c, ids, 120, cut_after=50, link=link)
                            except Exception as e:  # noqa: BLE001
                                rows.append(
                                    {
                                        "profile": prof.name,
                                        "set": "cut",
                                        "method": f"edge:{d}",
                                        "error": f"{type(e).__name__}: {e}",
                                    }
                                )
                                continue
                            finally:
                                c.close()
                            agree = sum(a == b for a, b in zip(ref["output"], r["output"])) / max(1, len(ref["output"]))
                            rows.append(
                                {
                                    "profile": prof.name,
                                    "set": "cut",
                                    "method": f"edge:{d}",
                                    **r,
                                    "agreement_with_connected": agree,
                                    "same_as_connected": r["output"] == ref["output"],
                                }
                            )
            finally:
                server.terminate()
                server.wait(30)
    for r in rows:
        r.pop("output", None)
    (out / "edge.json").write_text(
        json.dumps({"args": {k: v for k, v in vars(args).items() if k != "handler"}, "rows": rows}, indent=1)
    )
    print(_table(rows))
    return 0


def _table(rows: list[dict]) -> str:
    from collections import defaultdict

    groups = defaultdict(list)
    errors = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    for r in rows:
        if r["set"] != "cut":
            groups[(r["profile"], r["method"])].append(r)
    lines = [
        "| profile | method | tokens/s | × api | τ | server calls / token | bytes / cycle |",
        "|---|---|---|---|---|---|---|",
    ]
    api = {p: sum(x["tokens"] for x in g) / sum(x["seconds"] for x in g) for (p, m), g in groups.items() if m == "api"}
    for (p, m), g in groups.items():
        tps = sum(x["tokens"] for x in g) / sum(x["seconds"] for x in g)
        tau = sum(x.get("tau", 0) for x in g) / len(g)
        bpc = sum(x.get("bytes_per_cycle", 0) for x in g) / len(g)
        cpt = sum(x["calls_per_token"] for x in g) / len(g)
        lines.append(
            f"| {p} | {m} | {tps:.1f} | {tps / api[p]:.2f} | {tau:.2f} | {cpt:.3f} | {bpc:.0f} |"
            if m != "api"
            else f"| {p} | api (stream) | {tps:.1f} | 1.00 | – | {cpt:.3f} | – |"
        )
    for r in rows:
        if r["set"] == "cut":
            lines.append(
                f"\ncut ({r['profile']}, {r['method']}): {r['offline_tokens']} offline tokens, "
                f"{r['offline_kept']} kept after verify-resync; "
                f"{r['tokens']} verified tokens, same as connected: {r['same_as_connected']} "
                f"(agreement {r['agreement_with_connected']:.2f})"
            )
    lines += [f"\nfailed: {r['profile']} {r['set']} {r['method']}: {r['error']}" for r in errors]
    return "\n".join(lines)
