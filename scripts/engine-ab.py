"""Engine variants against each other in one run: the batch sweep's runners and prompts (six eval sets
round-robin, max(24, 2b) prompts served b at a time, 128 new tokens, greedy), every variant stepped in
turn, one engine step each, so the machine's drift hits them alike. Prints each variant's tokens/s
(whole run and at full batch) and its ratio to the first variant of the same drafter (vanilla or suffix).

Variants:
  vanilla, suffix           the serving engine (suffix: adaptive speculation, tree 3,1,4)
  vanilla-separate,         arrivals prefilled in a forward of their own before the decode forward
  suffix-separate           (EngineConfig(prefill="separate")): the engine before mixed prefill
  vanilla-mixed,            arrivals' prompt rows in the decode forward (EngineConfig(prefill="mixed"));
  suffix-mixed              the default ("first") gives arrivals a step of their own, one step in two at most
  suffix-nocut              adaptive speculation without the confident option (three options)

    MOA_SERVE_EVAL_DIR=../shared/data/eval .venv/bin/python scripts/engine-ab.py \\
        --variants vanilla,vanilla-separate,suffix,suffix-separate --batch-sizes 4,8,16
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace

import serving.engine as engine_module
from moa_serve.benchmarks.batch import engine_batch_runner, run_batch_sweep
from serving.adaptive import AdaptiveSpeculation
from serving.config import EngineConfig
from sglang_ext.evalsets import EVAL_SETS, load_eval_set
from sglang_ext.models import load_target
from sglang_ext.tree import TreeShape

Engine = engine_module.Engine


class SeparatePrefill(Engine):
    def __init__(self, target, drafter=None, config=None, **k):
        super().__init__(target, drafter, replace(config or EngineConfig(), prefill="separate"), **k)


class MixedPrefill(Engine):
    def __init__(self, target, drafter=None, config=None, **k):
        super().__init__(target, drafter, replace(config or EngineConfig(), prefill="mixed"), **k)


class NoConfidentOption(Engine):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        if self.policy is not None:
            self.policy = AdaptiveSpeculation(self.tree)


VARIANTS = {  # name -> (drafter method, engine class)
    "vanilla": ("vanilla", Engine),
    "vanilla-separate": ("vanilla", SeparatePrefill),
    "suffix": ("suffix", Engine),
    "suffix-separate": ("suffix", SeparatePrefill),
    "vanilla-mixed": ("vanilla", MixedPrefill),
    "suffix-mixed": ("suffix", MixedPrefill),
    "suffix-nocut": ("suffix", NoConfidentOption),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="vanilla,vanilla-separate,suffix,suffix-separate")
    ap.add_argument("--batch-sizes", default="4,8,16")
    ap.add_argument("--num-prompts", type=int, default=11, help="per eval set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    target = load_target("smollm2", dtype="float32")
    per_set = [
        [target.encode_chat([{"role": "user", "content": t}]) for t in load_eval_set(s, args.num_prompts)[1]]
        for s in EVAL_SETS
    ]
    prompts = [p for group in itertools.zip_longest(*per_set) for p in group if p is not None]
    drafters: dict = {}

    def make(name: str):
        method, cls = VARIANTS[name]

        def build():
            # the runner looks the engine class up when it is built
            engine_module.Engine = cls
            try:
                return engine_batch_runner(
                    target, method, TreeShape(3, 1, 4), args.max_new_tokens, method != "vanilla", drafters
                )
            finally:
                engine_module.Engine = Engine

        return build

    methods = [
        (name, "-" if VARIANTS[name][0] == "vanilla" else "3,1,4", VARIANTS[name][0] != "vanilla", make(name))
        for name in names
    ]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = run_batch_sweep(
        methods, prompts, batch_sizes, repeats=args.repeats, measure_memory=False, log=print, min_prompts=24
    )
    out = [
        dict(
            variant=r.method,
            batch_size=r.batch_size,
            tokens_per_s=r.tokens_per_s,
            full_tokens_per_s=r.full_tokens_per_s,
            tau=r.tau,
            error=r.error,
        )
        for r in rows
    ]
    for b in batch_sizes:
        at = {o["variant"]: o for o in out if o["batch_size"] == b}
        for name in names:
            base = next(n for n in names if VARIANTS[n][0] == VARIANTS[name][0])
            o, ref = at[name], at[base]
            if o["error"] or ref["error"]:
                print(f"bs {b} {name}: failed: {o['error'] or ref['error']}")
                continue
            vs_vanilla = ""
            if "vanilla" in at and VARIANTS[name][0] != "vanilla":
                v = at["vanilla"]
                vs_vanilla = (
                    f"; x vanilla {o['tokens_per_s'] / v['tokens_per_s']:.3f} "
                    f"(full batch {o['full_tokens_per_s'] / v['full_tokens_per_s']:.3f})"
                )
            print(
                f"bs {b} {name}: {o['tokens_per_s']:.1f} tok/s (full batch {o['full_tokens_per_s']:.1f}), "
                f"tau {o['tau']:.2f}; "
                f"x {base} {o['tokens_per_s'] / ref['tokens_per_s']:.3f} "
                f"(full batch {o['full_tokens_per_s'] / ref['full_tokens_per_s']:.3f}){vs_vanilla}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
