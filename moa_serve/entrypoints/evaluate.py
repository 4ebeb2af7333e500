"""`python -m moa_serve.entrypoints.evaluate`: tau of a drafter checkpoint on the eval sets
(moa_serve/benchmarks/evaluate.py)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moa_serve.benchmarks.evaluate import evaluate


def main(argv: list[str] | None = None) -> int:
    from sglang_ext.drafters import make_drafter
    from sglang_ext.evalsets import load_eval_set
    from sglang_ext.models import load_target
    from sglang_ext.tree import TreeShape

    ap = argparse.ArgumentParser(prog="python -m moa_serve.entrypoints.evaluate")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (default: the shipped one)")
    ap.add_argument("--trees", nargs="+", default=["6,4,24"])
    ap.add_argument("--sets", default="mt_bench,humaneval,gsm8k,alpaca,sum,qa")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    drafter = make_drafter(args.ckpt or args.drafter, target)  # a checkpoint path names its own type
    results = []
    for name in args.sets.split(","):
        texts = load_eval_set(name, args.num_prompts)[1]
        prompts = [target.encode_chat([{"role": "user", "content": t}]) for t in texts]
        for tree in args.trees:
            res = {
                "set": name,
                "tree": tree,
                **evaluate(target, drafter, TreeShape.parse(tree), prompts, args.max_new_tokens),
            }
            results.append(res)
            print(
                f"{name:10s} tree {tree:8s} tau {res['tau']:.3f}  ({res['tokens']} tokens, {res['tokens_per_s']:.1f} "
                "tok/s)",
                flush=True,
            )
    for tree in args.trees:
        taus = [r["tau"] for r in results if r["tree"] == tree]
        print(f"{'mean':10s} tree {tree:8s} tau {sum(taus) / len(taus):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
