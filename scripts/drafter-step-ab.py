"""Process time per engine step of vanilla and drafters, steps interleaved method by method (a busy machine's drift
and other jobs hit every method alike; process time leaves out the time others hold the cores), and where a
drafter's own time goes.

    .venv/bin/python scripts/drafter-step-ab.py --methods 'eagle3;moa' --steps 40

Per eval set one prompt (its first, 600 characters), one steady request per method (EOS ignored), `--steps` steps
each after three warm ones. Prints per method: CPU ms per step, that over vanilla's, τ of those steps (tokens per
step) and τ / step ratio: the speed-up the steps imply. Then the drafter's parts (CPU ms per step): `propose`,
`commit` and, wrapped by name where the drafter has them, its pieces (`--parts`); with `--warm`, MoA's LSA commit
and pass each also run again right after, timed apart (what they cost with their weights in the caches; the step's
time then counts both runs: read the step figures from a run without it).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict

import torch

# drafter methods timed on their own, where the drafter has them (the rest of propose is plans, search and glue)
PARTS = ("_extend", "_pending_features", "_layer", "_flush", "context", "_commit_q8", "_ingest", "_pass_q8")
# parts that leave the same state when run twice (MoA's LSA commit returns its rows; its pass rewrites the same SA
# K/V): with --warm each runs again at once, its second run timed apart ("<part> warm": caches warm from the first)
REPEATABLE = ("_commit_q8", "_pass_q8")


def _timed(obj, name: str, acc: dict, label: str, warm: bool = False) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def run(*a, **k):
        t0 = time.process_time()
        try:
            return fn(*a, **k)
        finally:
            t1 = time.process_time()
            acc[label] += t1 - t0
            if warm:
                fn(*a, **k)
                acc[label + " warm"] += time.process_time() - t1

    setattr(obj, name, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="eagle3;moa", help="drafter[:tree] ';'-separated (vanilla always runs)")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per method and prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sets", default="mt_bench,humaneval,gsm8k,alpaca,sum,qa")
    ap.add_argument("--parts", action="store_true", help="also time the drafter's pieces")
    ap.add_argument(
        "--warm", action="store_true", help="with --parts: time MoA's LSA commit and pass run again at once"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from serving.config import EngineConfig
    from serving.engine import Engine
    from sglang_ext.drafters import default_tree, make_drafter
    from sglang_ext.evalsets import load_eval_set
    from sglang_ext.models import load_target
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    target = load_target("smollm2", dtype="auto")
    methods = ["vanilla", *args.methods.split(";")]
    drafters = {}
    live, parts = {m: defaultdict(float) for m in methods}, {m: defaultdict(float) for m in methods}
    for m in methods[1:]:  # one drafter per method: their per-request states stay apart
        name = m.partition(":")[0]
        drafters[m] = d = make_drafter(name, target)
        for p in ("propose", "commit", *(PARTS if args.parts else ())):
            if hasattr(d, p):
                _timed(d, p, live[m], p, args.warm and p in REPEATABLE)
    total = {m: [0.0, 0, 0] for m in methods}  # CPU seconds, steps, tokens
    for s in args.sets.split(","):
        text = load_eval_set(s, 1)[1][0]
        prompt = target.encode_chat([{"role": "user", "content": text[:600]}])
        engines = {}
        for m in methods:
            tree = m.partition(":")[2]
            d = drafters.get(m)
            shape = TreeShape.parse(tree) if tree else default_tree(m if d is not None else None)
            kv = len(prompt) + 4 * args.steps + 200
            eng = Engine(target, d, EngineConfig(tree=shape, kv_slots=kv, prefix_cache=False))
            req = eng.add_request(prompt, SamplingParams(max_new_tokens=3 * args.steps + 20, ignore_eos=True))
            while eng.waiting:
                eng.step()
            for _ in range(3):
                eng.step()
            engines[m] = (eng, req)
        before = {m: dict(live[m]) for m in methods}  # (prefill and warm steps: not counted)
        for _ in range(args.steps):
            for m, (eng, req) in engines.items():
                n0 = len(req.output_ids)
                t0 = time.process_time()
                eng.step()
                total[m][0] += time.process_time() - t0
                total[m][1] += 1
                total[m][2] += len(req.output_ids) - n0
        for eng, req in engines.values():
            eng.abort(req)
        for m in methods:
            for k, v in live[m].items():
                parts[m][k] += v - before[m].get(k, 0.0)
    base = total["vanilla"][0] / total["vanilla"][1]
    print(f"{args.threads} thread(s), {args.steps} steps per method and prompt, sets {args.sets}")
    for m, (cpu, n, tokens) in total.items():
        step, tau = cpu / n, tokens / n
        print(
            f"{m:24s} step {1e3 * step:6.2f} ms = {step / base:.2f}x vanilla's, tau {tau:.2f}: {tau * base / step:.2f}x"
        )
    for m in methods[1:]:
        steps = total[m][1]
        print(m, ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in parts[m].items()), "(ms per step)")


if __name__ == "__main__":
    main()
