"""The noisy-neighbour benchmark: tenant A floods the server at 3x its capacity, tenant B sends one request at a
time; B's p95 time to first token during the flood against B's TTFT alone, in the same run (goal: <= 2x; the
ratio is given to B's p95 alone, the same percentile, and to its p50).

Starts `moa-serve serve` (the embedded engine, its defaults unless flags say otherwise) with a plain two-key file
(two tenants of equal weight: key1 floods, key2 is steady) and `--max-running N --max-queue N`, waits for it, then
runs loadtest/tenants.py under headless locust: B alone for --alone-s seconds, then A's `--flood-factor x N`
users (each keeping a streamed request in flight, honouring Retry-After after a 429) beside B for --flood-s
seconds. With --shared-key a second server run gives both clients one key (one tenant: what the gateway did
before tenants, and what a server without them does). Writes results.json and table.md under --out.

    .venv/bin/python scripts/noisy-neighbour.py --threads 2 --shared-key --out results/noisy-neighbour
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"
KEYS = ("sk-noisy-neighbour-flood", "sk-noisy-neighbour-steady")


def main() -> int:
    args = parse_args()
    locust = args.locust or find_locust()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {"tenants": run(args, locust, out, shared=False)}
    if args.shared_key:
        runs["one key"] = run(args, locust, out, shared=True)
    result = {"args": vars(args), "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    table = render(runs, args)
    (out / "table.md").write_text(table)
    print(table)
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-running", type=int, default=4, help="the server's --max-running (its capacity)")
    p.add_argument("--max-queue", type=int, default=None, help="the server's --max-queue (default: --max-running)")
    p.add_argument("--flood-factor", type=float, default=3.0, help="A's users = this x --max-running")
    p.add_argument("--alone-s", type=float, default=30.0)
    p.add_argument("--flood-s", type=float, default=60.0)
    p.add_argument("--steady-wait", type=float, default=0.5, help="seconds between B's requests")
    p.add_argument("--flood-max-tokens", type=int, default=128)
    p.add_argument("--steady-max-tokens", type=int, default=32)
    p.add_argument(
        "--prompts",
        default=str(MT_BENCH) if MT_BENCH.is_file() else None,
        help="A's prompts (MOA_LOADTEST_PROMPTS; default: MT-bench's first turns when ../shared has them, else "
        "loadtest/chat.py's built-in list)",
    )
    p.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    p.add_argument("--serve-args", default="", help="more `moa-serve serve` flags, e.g. '--drafter ngram'")
    p.add_argument("--shared-key", action="store_true", help="also run with one key for both (one tenant)")
    p.add_argument("--locust", default=None, help="the locust binary (default: beside this Python, or on PATH)")
    p.add_argument("--out", default="results/noisy-neighbour")
    args = p.parse_args()
    if args.max_queue is None:
        args.max_queue = args.max_running
    return args


def find_locust() -> str:
    beside = Path(sys.executable).parent / "locust"
    found = str(beside) if beside.is_file() else shutil.which("locust")
    if not found:
        sys.exit("noisy-neighbour: locust not found (make deploy-tools installs it into .venv; or --locust PATH)")
    return found


def run(args, locust: str, out: Path, shared: bool) -> dict:
    name = "one-key" if shared else "tenants"
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "api-keys"
        keys.write_text(KEYS[0] + "\n" + ("" if shared else KEYS[1] + "\n"))
        port = free_port()
        server = start_server(args, keys, port, out / f"{name}-server.log")
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, server)
            warm_up(url, KEYS[0])
            summary = Path(tmp) / "summary.json"
            env = {
                **os.environ,
                "MOA_LOADTEST_FLOOD_KEY": KEYS[0],
                "MOA_LOADTEST_STEADY_KEY": KEYS[0] if shared else KEYS[1],
                "MOA_LOADTEST_ALONE_S": str(args.alone_s),
                "MOA_LOADTEST_FLOOD_S": str(args.flood_s),
                "MOA_LOADTEST_FLOOD_USERS": str(round(args.flood_factor * args.max_running)),
                "MOA_LOADTEST_STEADY_WAIT": str(args.steady_wait),
                "MOA_LOADTEST_FLOOD_MAX_TOKENS": str(args.flood_max_tokens),
                "MOA_LOADTEST_STEADY_MAX_TOKENS": str(args.steady_max_tokens),
                "MOA_LOADTEST_SUMMARY": str(summary),
            }
            if args.prompts:
                env["MOA_LOADTEST_PROMPTS"] = args.prompts
            cmd = [locust, "-f", str(ROOT / "loadtest" / "tenants.py"), "--host", url, "--headless"]
            cmd += ["--csv", str(out / name), "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "0"]
            limit = args.alone_s + args.flood_s + 300
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
            (out / f"{name}-locust.log").write_text(proc.stdout + proc.stderr)
            if not summary.is_file():
                sys.exit(f"noisy-neighbour: locust wrote no summary (see {out / f'{name}-locust.log'})")
            result = json.loads(summary.read_text())
            result["server"] = tenant_counts(httpx.get(url + "/metrics", timeout=30).text)
            return result
        finally:
            server.terminate()
            server.wait(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, keys: Path, port: int, log: Path) -> subprocess.Popen:
    script = Path(sys.executable).parent / "moa-serve"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "moa_serve.entrypoints.cli"]
    cmd += ["serve", "--port", str(port), "--api-keys-file", str(keys), "--threads", str(args.threads)]
    cmd += ["--max-running", str(args.max_running), "--max-queue", str(args.max_queue), "--no-access-log"]
    cmd += args.serve_args.split()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for var in ("MOA_SERVE_API_KEYS", "MOA_SERVE_BACKEND", "MOA_SERVE_UPSTREAM"):
        env.pop(var, None)
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"noisy-neighbour: the server exited ({server.returncode}); see its log")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit("noisy-neighbour: the server was not ready in time")


def warm_up(url: str, key: str) -> None:
    """A few requests before the measurement (first-use costs, the adaptive policy's first measurements), which
    the loadtest's numbers do not include."""
    body = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16, "temperature": 0}
    with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for _ in range(4):
            c.post("/v1/chat/completions", json={**body, "model": model}).raise_for_status()


def tenant_counts(metrics: str) -> dict:
    """The gateway's own per-tenant counts: requests by status and rejections by reason."""
    out: dict = {}
    for line in metrics.splitlines():
        if not line.startswith(("moa_tenant_requests_total{", "moa_tenant_rejections_total{")):
            continue
        series, value = line.rsplit(" ", 1)
        family, labels = series.split("{", 1)
        fields = dict(kv.split("=", 1) for kv in labels.rstrip("}").split(","))
        what = fields.get("status") or fields.get("reason")
        kind = "requests" if "requests" in family else "rejections"
        out.setdefault(fields["tenant"].strip('"'), {}).setdefault(kind, {})[what.strip('"')] = float(value)
    return out


def render(runs: dict, args) -> str:
    lines = [
        f"Noisy neighbour: --max-running {args.max_running} --max-queue {args.max_queue}, "
        f"{round(args.flood_factor * args.max_running)} flood users ({args.flood_max_tokens} tokens each), "
        f"1 steady user ({args.steady_max_tokens} tokens, {args.steady_wait} s apart); alone {args.alone_s:.0f} s, "
        f"flood {args.flood_s:.0f} s",
        "",
        "| keys | B TTFT alone p50 / p95 (s) | B TTFT in the flood p50 / p95 (s) | B p95 flood / p95 alone | "
        "B p95 flood / p50 alone | B 429s | A streams | A 429s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        alone, flood, a = r["steady"]["alone"], r["steady"]["flood"], r["flood"]
        same, center = ratios(r)
        lines.append(
            f"| {name} | {fmt(alone)} | {fmt(flood)} | {times(same)} | {times(center)} | {r['steady']['rejected']} | "
            f"{a['flood'].get('count', 0)} | {a['rejected']} |"
        )
    same, _ = ratios(runs["tenants"])
    verdict = "met" if same is not None and same <= 2 else "not met"
    lines += ["", f"Goal (tenants): B's p95 TTFT in the flood <= 2x B's p95 TTFT alone: {verdict}."]
    return "\n".join(lines) + "\n"


def ratios(r: dict) -> tuple[float | None, float | None]:
    """B's p95 in the flood over its p95 alone, and over its p50 alone."""
    alone, flood = r["steady"]["alone"], r["steady"]["flood"]
    if not (alone.get("count") and flood.get("count")):
        return None, None
    return flood["p95"] / alone["p95"], flood["p95"] / alone["p50"]


def times(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def fmt(s: dict) -> str:
    return f"{s['p50']:.3f} / {s['p95']:.3f} (n={s['count']})" if s.get("count") else "none"


if __name__ == "__main__":
    sys.exit(main())
