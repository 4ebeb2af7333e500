"""Which lookup-drafter nodes are worth a verify row: teacher-forced acceptance of the suffix drafter's
chains against features of the match behind them.

The target generates greedy answers (vanilla, 128 tokens) for some eval prompts; then at every position
of every answer the shipped suffix drafter proposes a chain from the context so far, and the chain is
checked against what the target really generated next (greedy verification accepts exactly that
prefix). Finished answers join the online corpus in order, as in a server. NOTE: every position counts
once, so repetitive stretches weigh more than in real decoding (which skips accepted tokens): read the
acceptance per feature, not the overall tau.

    MOA_SERVE_EVAL_DIR=../shared/data/eval .venv/bin/python scripts/lookup-acceptance.py --prompts 20:28
"""

from __future__ import annotations

import argparse
import collections

import torch

from serving.engine import Engine
from sglang_ext.drafters.ngram import match_confidence, trie_tree
from sglang_ext.drafters.suffix import SuffixDrafter
from sglang_ext.evalsets import EVAL_SETS, load_eval_set
from sglang_ext.models import load_target
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape


def proposals(drafter: SuffixDrafter, prompt: list[int], answer: list[int], shape: TreeShape):
    """Per answer position: (own match length, per-node share of the candidates, accepted nodes)."""
    for t in range(1, len(answer)):
        ctx = prompt + answer[:t]
        own_len, weighted = drafter.candidates(ctx, shape.depth)
        chain = trie_tree(ctx[-1], len(ctx), weighted, shape, drafter.min_share).draft_tokens[1:].tolist()
        total = sum(w for _, w in weighted) or 1.0
        shares = [sum(w for c, w in weighted if c[: k + 1] == chain[: k + 1]) / total for k in range(len(chain))]
        accepted = 0
        while accepted < len(chain) and accepted < len(answer) - t and chain[accepted] == answer[t + accepted]:
            accepted += 1
        yield own_len, shares, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--prompts",
        default="20:28",
        help="slice of each eval set's prompts (default 20:28; the sweeps use the first 11)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default="3,1,4", help="the suffix drafter's serving default chain")
    args = ap.parse_args()
    torch.set_num_threads(2)
    a, b = (int(x) for x in args.prompts.split(":"))
    target = load_target()
    prompts = []
    for name in EVAL_SETS:
        _, texts = load_eval_set(name, b)
        prompts += [target.encode_chat([{"role": "user", "content": t}]) for t in texts[a:b]]
    answers = [
        r.output_ids for r in Engine(target, None).generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
    ]
    shape = TreeShape.parse(args.tree)
    drafter = SuffixDrafter.from_target(target)
    rows = []
    for p, ans in zip(prompts, answers):
        rows += proposals(drafter, p, ans, shape)
        drafter.add_output(ans)
    print(f"{len(prompts)} prompts, {sum(map(len, answers))} tokens, {len(rows)} positions, tree {shape.label}\n")
    print("| own match (tokens) | positions | nodes / position | accepted / node |\n|---|---|---|---|")
    by_len = collections.defaultdict(lambda: [0, 0, 0])
    for own_len, shares, acc in rows:
        s = by_len[min(own_len, 4)]
        s[0], s[1], s[2] = s[0] + 1, s[1] + len(shares), s[2] + acc
    for k in sorted(by_len):
        n, nodes, acc = by_len[k]
        print(f"| {k}{'+' if k == 4 else ''} | {n} | {nodes / n:.2f} | {acc / max(nodes, 1):.2f} |")
    print("\n| nodes kept | verify rows / position | accepted / position | accepted / node |\n|---|---|---|---|")
    rules = {"all": lambda own, k, s: True, "depth <= own match": lambda own, k, s: k < own}
    rules |= {
        f"min_prob {p} (share x match confidence)": (lambda own, k, s, p=p: s * match_confidence(own) >= p)
        for p in (0.2, 0.3, 0.5)
    }
    for name, keep in rules.items():
        nodes = acc = 0
        for own_len, shares, accepted in rows:
            kept = next((k for k, s in enumerate(shares) if not keep(own_len, k, s)), len(shares))
            nodes, acc = nodes + kept, acc + min(accepted, kept)
        print(f"| {name} | {nodes / len(rows):.2f} | {acc / len(rows):.2f} | {acc / max(nodes, 1):.2f} |")


if __name__ == "__main__":
    main()
