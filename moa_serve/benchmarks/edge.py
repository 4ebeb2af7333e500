"""`moa-serve edge-bench` (moa_serve/entrypoints/edge.py parses its flags): client–server decoding over emulated links.

It puts the server on its own host (a network namespace joined by a veth pair, tbf for
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
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class EdgeBenchSettings:
    """What one edge-bench run measures (the `moa-serve edge-bench` flags, their defaults these)."""

    profiles: str = "5g,4g"  # comma list of lan,5g,4g
    drafters: str = "moa-tli0,moa-tli1,eagle3"
    server_drafter: str = "none"  # the server's own drafter for the API baseline
    sets: str = "humaneval,mt_bench"
    prompts: int = 3  # prompts per set
    max_new_tokens: int = 96
    wire_dtype: str = "fp16"
    also_int8: bool = False  # add rows with int8 context to measure its effect on τ
    trees: str = ""  # ';'-separated tree shapes to compare per drafter; '': each drafter's default tree
    cut: bool = False  # add the disconnect run (link cut after 50 tokens)
    threads: int = 1  # torch threads for the client and for the server
    out: str = "results/edge"


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx  # (the `bench` extra's; `moa-serve edge-bench --help` builds its flags without it)

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
    import httpx

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


def run_edge_bench(s: EdgeBenchSettings) -> list[dict]:
    """Every profile's rows (see the module docstring); also written to s.out/edge.json."""
    import torch

    from moa_serve.benchmarks.netem import PROFILES, namespaces_available
    from serving.edge.client import local_drafter
    from sglang_ext.evalsets import load_eval_set
    from sglang_ext.models import load_target
    from sglang_ext.tree import TreeShape

    trees = {t.strip(): TreeShape.parse(t) for t in s.trees.split(";") if t.strip()}  # bad input fails first
    reason = namespaces_available()
    if reason:
        raise RuntimeError(f"edge-bench {reason}")
    torch.set_num_threads(s.threads)
    profiles = [PROFILES[p] for p in s.profiles.split(",")]
    drafters = [d for d in s.drafters.split(",") if d]
    target = load_target("smollm2", dtype="auto")
    local = {d: local_drafter(target, d) for d in drafters}
    prompts = []
    for name in s.sets.split(","):
        _, texts = load_eval_set(name, s.prompts)
        prompts += [(name, t) for t in texts]
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for prof in profiles:
        rows += _profile_rows(s, prof, target, local, prompts, trees, out)
    for r in rows:
        r.pop("output", None)
    (out / "edge.json").write_text(json.dumps({"args": {"command": "edge-bench", **asdict(s)}, "rows": rows}, indent=1))
    return rows


def _server_command(s: EdgeBenchSettings, host: str, drafters: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moa_serve.entrypoints.cli",
        "serve",
        "--host",
        host,
        "--port",
        "8000",
        "--drafter",
        s.server_drafter,
        "--edge-drafters",
        ",".join(drafters),
        "--threads",
        str(s.threads),
        "--log-level",
        "warning",
        "--no-access-log",
    ]


def _profile_rows(s: EdgeBenchSettings, prof, target, local: dict, prompts: list, trees: dict, out: Path) -> list[dict]:
    """One profile: the server in its own namespace, every prompt through the api and each edge method."""
    from moa_serve.benchmarks.netem import LinkProxy, NamespaceHost

    rows: list[dict] = []
    with NamespaceHost(1, prof.rate_mbit) as host:
        log = open(out / f"server-{prof.name}.log", "w")
        server = host.popen(_server_command(s, host.ns_ip, list(local)), stdout=subprocess.DEVNULL, stderr=log)
        try:
            with LinkProxy(host.ns_ip, 8000, prof, seed=0) as link:
                _wait_ready(link.url, server)
                for set_name, text in prompts:
                    ids = target.encode_chat([{"role": "user", "content": text}])
                    api = _api_run(link.url, text, s.max_new_tokens)
                    rows.append({"profile": prof.name, "set": set_name, "method": "api", **api})
                    rows += _edge_rows(s, prof.name, set_name, link.url, target, local, ids, trees)
                if s.cut:
                    rows += _cut_rows(s, prof.name, link, target, local, prompts)
        finally:
            server.terminate()
            server.wait(30)
    return rows


def _edge_rows(s: EdgeBenchSettings, profile: str, set_name: str, url: str, target, local, ids, trees) -> list[dict]:
    """One prompt through each (drafter, wire dtype, tree) edge method; a failing one is a row with its error."""
    from serving.edge.client import EdgeClient
    from sglang_ext.drafters import default_tree

    wire = [s.wire_dtype] + (["int8"] if s.also_int8 and s.wire_dtype != "int8" else [])
    rows = []
    for d, w, tree in [(d, w, t) for d in local for w in wire for t in (trees or [None])]:
        method = f"edge:{d}" + ("" if w == s.wire_dtype else f":{w}") + (f"@{tree}" if tree else "")
        shape = trees[tree] if tree else default_tree(d)
        c = EdgeClient(url, local[d], d, shape, w, timeout_s=2.0, eos_ids=tuple(target.cfg.eos_token_ids))
        try:
            r = _edge_run(c, ids, s.max_new_tokens)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            rows.append({"profile": profile, "set": set_name, "method": method, "error": f"{type(e).__name__}: {e}"})
            continue
        finally:
            c.close()
        rows.append({"profile": profile, "set": set_name, "method": method, **r})
        print(
            f"[edge-bench] {profile} {set_name} {method}: {r['tokens_per_s']:.1f} tok/s τ {r['tau']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def _cut_rows(s: EdgeBenchSettings, profile: str, link, target, local: dict, prompts: list) -> list[dict]:
    """The first prompt with each MoA drafter, connected and then with the link cut after 50 tokens."""
    from serving.edge.client import EdgeClient
    from sglang_ext.drafters import default_tree

    rows = []
    _, text = prompts[0]
    ids = target.encode_chat([{"role": "user", "content": text}])
    for d in [x for x in local if x.startswith("moa")]:
        c = EdgeClient(link.url, local[d], d, default_tree(d), s.wire_dtype, timeout_s=1.0, eos_ids=())
        try:
            ref = _edge_run(c, ids, 120)
            r = _edge_run(c, ids, 120, cut_after=50, link=link)
        except Exception as e:  # noqa: BLE001
            rows.append({"profile": profile, "set": "cut", "method": f"edge:{d}", "error": f"{type(e).__name__}: {e}"})
            continue
        finally:
            c.close()
        agree = sum(a == b for a, b in zip(ref["output"], r["output"])) / max(1, len(ref["output"]))
        rows.append(
            {
                "profile": profile,
                "set": "cut",
                "method": f"edge:{d}",
                **r,
                "agreement_with_connected": agree,
                "same_as_connected": r["output"] == ref["output"],
            }
        )
    return rows


def edge_table(rows: list[dict]) -> str:
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
