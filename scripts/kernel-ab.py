"""Same-run A/B of the CPU linear kernel: SmolLM2 forwards of 1-64 rows (decode and verify sizes)
with the kernel and with torch's F.linear, interleaved so machine drift hits both alike.

    .venv/bin/python scripts/kernel-ab.py [--threads 2] [--prefix 400] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang_ext import kernels
from sglang_ext.attention import causal_mask, plan_attention, prefix_and_tree_mask
from sglang_ext.models import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=400, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", default="1,2,4,6,8,16,32,64")
    args = ap.parse_args()
    if not kernels.AVAILABLE:
        raise SystemExit(f"kernel unavailable: {kernels.UNAVAILABLE}")
    torch.set_num_threads(args.threads)
    model = load_target("smollm2", dtype="float32").model
    p = args.prefix
    kv = model.new_kv_pool(p + 256)
    prefix = torch.arange(1, p + 1)
    model.forward(torch.randint(0, model.cfg.vocab_size, (p,)), torch.arange(p), prefix, plan_attention([prefix], [causal_mask(p, 0)]), kv)
    print(f"| rows | kernel ms | torch ms | kernel speedup |\n|---|---|---|---|")
    for n in (int(x) for x in args.rows.split(",")):
        new = torch.arange(p + 1, p + 1 + n)
        plan = plan_attention([torch.cat([prefix, new])], [prefix_and_tree_mask(torch.tril(torch.ones(n, n, dtype=torch.bool)), p)])
        ids, pos = torch.randint(0, model.cfg.vocab_size, (n,)), torch.arange(p, p + n)
        times = {True: [], False: []}
        for i in range(args.repeats + 2):
            for on in (True, False):
                kernels.AVAILABLE = on
                t0 = time.perf_counter()
                out = model.forward(ids, pos, new, plan, kv)
                model.logits(out.hidden, fp32=False)
                if i >= 2:  # warm-up
                    times[on].append(time.perf_counter() - t0)
        kernels.AVAILABLE = True
        on, off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"| {n} | {on:.1f} | {off:.1f} | {off / on:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
