"""How long running streams wait while a long prompt is prefilled, by chunk size (Engine prefill_tokens).

Four short requests (MT-bench prompts) decode with the suffix drafter and adaptive speculation; then a
long prompt (the `sum` eval set's texts joined, cut to --long-tokens) arrives. Per chunk size: the steps
until the long prompt's first token, the longest of those steps (what every running stream waits for
its next token) and the long prompt's time to first token.

    MOA_SERVE_EVAL_DIR=../shared/data/eval .venv/bin/python scripts/chunked-prefill-latency.py --chunks 2048,512,256
"""

from __future__ import annotations

import argparse
import time

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import make_drafter
from sglang_ext.evalsets import load_eval_set
from sglang_ext.models import load_target
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="2048,512,256")
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    target = load_target("smollm2", dtype="float32")
    short = [target.encode_chat([{"role": "user", "content": x[:300]}]) for x in load_eval_set("mt_bench", 4)[1]]
    long = target.encode_chat([{"role": "user", "content": " ".join(load_eval_set("sum", 11)[1])}])[: args.long_tokens]
    print(f"long prompt: {len(long)} tokens")
    drafter = make_drafter("suffix", target)
    for _ in range(args.repeats):
        for chunk in (int(c) for c in args.chunks.split(",")):
            eng = Engine(
                target,
                drafter,
                EngineConfig(tree=TreeShape(3, 1, 4), adaptive=True, prefill_tokens=chunk, kv_slots=8192),
            )
            running = [eng.add_request(p, SamplingParams(max_new_tokens=200, ignore_eos=True)) for p in short]
            for _ in range(5):
                eng.step()
            arrival = eng.add_request(long, SamplingParams(max_new_tokens=8))
            steps, t_start = [], time.perf_counter()
            while arrival.t_first_token is None:
                t0 = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t0)
            print(
                f"chunk {chunk}: {len(steps)} steps to the long prompt's first token, longest step "
                f"{max(steps) * 1000:.0f} ms, "
                f"its TTFT {(arrival.t_first_token - t_start) * 1000:.0f} ms"
            )
            for r in running + [arrival]:
                eng.abort(r)


if __name__ == "__main__":
    main()
