"""Acceptance length (tau) of a trained drafter checkpoint on the shared eval sets, greedy, bs=1.

    python -m moa_serve.entrypoints.evaluate --drafter eagle3 --ckpt runs/x/final \
        --trees 6,1,7 6,4,24 6,8,48 --sets mt_bench,gsm8k --num-prompts 10 --max-new-tokens 128

Prompts: the first user turn ("turns"[0]) of each record, in the target's chat template. Prints a
table and writes JSON (--out). Speed ratios belong to `moa-serve bench`; this is for choosing
checkpoints and tree shapes.
"""

from __future__ import annotations

import time


def evaluate(target, drafter, shape, prompts: list[list[int]], max_new_tokens: int) -> dict:
    from serving.config import EngineConfig
    from serving.engine import Engine
    from sglang_ext.sampling import SamplingParams

    eng = Engine(target, drafter, EngineConfig(tree=shape, prefix_cache=False))  # (acceptance only: no cache needed)
    steps = accepted = tokens = 0
    t0 = time.perf_counter()
    for p in prompts:
        r = eng.generate([p], SamplingParams(max_new_tokens=max_new_tokens))[0]
        steps += r.stats.verify_steps
        accepted += r.stats.accepted_tokens
        tokens += len(r.output_ids)
    dt = time.perf_counter() - t0
    return {
        "tau": (accepted + steps) / max(steps, 1),
        "verify_steps": steps,
        "tokens": tokens,
        "tokens_per_s": tokens / dt,
    }
