"""Predicted outputs, bs 1, greedy, one run: each request asks a variant of an earlier question, and its
prediction is the target's answer to that earlier question (the "regenerate with a change" case: the
text is not in the prompt). Methods run interleaved request by request:

  vanilla              no drafter (the speed reference)
  suffix               the shipped suffix drafter, tree 3,1,4, no prediction
  suffix+prediction    the same with the prediction
  suffix6+prediction   a deeper chain (6,1,7) with the prediction
  D, D+prediction      for each model drafter D of --model-drafters (e.g. eagle3,moa): its default tree,
                       without and with the prediction (drafted from where the output matches it)

All outputs are checked equal to vanilla's (a prediction never changes the output). Prints tokens/s,
the ratio to vanilla and tau; writes results/<out>/results.json.

    .venv/bin/python scripts/prediction-bench.py --out results/prediction
    .venv/bin/python scripts/prediction-bench.py --model-drafters eagle3,moa --out results/prediction-models
"""

from __future__ import annotations

import argparse
import time

from bench_table import new_totals, record, report

from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import default_tree, make_drafter
from sglang_ext.models import load_target
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

TASKS = [  # (earlier question, the variant asked now)
    (
        "Write a Python function that checks whether a number is prime, with a docstring.",
        "Write a Python function that checks whether a number is prime, with a docstring and type hints.",
    ),
    (
        "Write a Python function that reverses a string.",
        "Write a Python function that reverses a string, with comments.",
    ),
    (
        "Write a Python function that returns the n-th Fibonacci number.",
        "Write a Python function that returns the n-th Fibonacci number, iteratively.",
    ),
    (
        "Write a Python class for a bank account with deposit and withdraw methods.",
        "Write a Python class for a bank account with deposit and withdraw methods and a balance property.",
    ),
    (
        "Write a JavaScript function that sums an array of numbers.",
        "Write a JavaScript function that sums an array of numbers, with a JSDoc comment.",
    ),
    (
        "Write a SQL query that lists the ten most expensive products.",
        "Write a SQL query that lists the ten most expensive products with their categories.",
    ),
    ("Explain how a rainbow forms.", "Explain how a rainbow forms, briefly."),
    ("Give three tips for better sleep.", "Give three tips for better sleep, as a numbered list."),
    (
        "Write a short email asking a colleague for a meeting.",
        "Write a short, formal email asking a colleague for a meeting.",
    ),
    ("Summarize the water cycle.", "Summarize the water cycle for a ten-year-old."),
    ("List the planets of the solar system.", "List the planets of the solar system in order from the Sun."),
    (
        "Write a Python function that counts the words in a text.",
        "Write a Python function that counts the words in a text, ignoring case.",
    ),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--model-drafters", default="", help="comma list of model drafters to add (e.g. eagle3,moa)")
    ap.add_argument("--out", default="results/prediction")
    args = ap.parse_args()
    target = load_target("smollm2", dtype="float32")
    vanilla = Engine(target, None)
    methods = {
        "vanilla": (vanilla, False),
        "suffix": (Engine(target, make_drafter("suffix", target), EngineConfig(tree=TreeShape(3, 1, 4))), False),
        "suffix+prediction": (
            Engine(target, make_drafter("suffix", target), EngineConfig(tree=TreeShape(3, 1, 4))),
            True,
        ),
        "suffix6+prediction": (
            Engine(target, make_drafter("suffix", target), EngineConfig(tree=TreeShape(6, 1, 7))),
            True,
        ),
    }
    for name in filter(None, args.model_drafters.split(",")):
        methods[name] = (Engine(target, make_drafter(name, target), EngineConfig(tree=default_tree(name))), False)
        methods[name + "+prediction"] = (
            Engine(target, make_drafter(name, target), EngineConfig(tree=default_tree(name))),
            True,
        )
    totals = new_totals(methods, "same_as_vanilla")
    for earlier, now in TASKS[: args.num_prompts]:
        first = vanilla.generate(
            [target.encode_chat([{"role": "user", "content": earlier}])],
            SamplingParams(max_new_tokens=args.max_new_tokens),
        )[0].output_ids
        ids = target.encode_chat([{"role": "user", "content": now}])
        outputs = {}
        for name, (eng, predicted) in methods.items():
            params = SamplingParams(max_new_tokens=args.max_new_tokens, prediction=tuple(first) if predicted else ())
            t0 = time.perf_counter()
            r = eng.generate([ids], params)[0]
            record(totals[name], r, time.perf_counter() - t0)
            outputs[name] = r.output_ids
            totals[name]["same_as_vanilla"] += r.output_ids == outputs["vanilla"]
    report(totals, ("same_as_vanilla",), args, args.out)


if __name__ == "__main__":
    main()
