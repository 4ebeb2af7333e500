"""Where a CPU decode or tree-verify step of the target goes, beside this machine's floor.

    .venv/bin/python scripts/cpu-step-profile.py [--threads 2] [--prefix 400] [--rows 1,2,4,8,16] [--repeats 30]

One forward of `rows` new tokens over a `prefix`-token KV cache, then the head over every row (what the engine's
decode and verify steps run), at both CPU dtypes:
  q8       the whole stack in one call (kernels/cpu_q8.cpp); its phases timed inside the call (Q8Stack.set_profile:
           thread 0 reads a clock after each phase's barrier), and the Python around it
  float32  the per-layer path on our fp32 kernels (GGUF blocks dequantised in registers; the layer glue ops; the
           attention kernel): each op of the layer timed as it runs, and the rest (Python and dispatch between
           them) as what the untimed forward takes beyond the ops
The floor: the bytes a step must read (the layers' GGUF blocks, the head's, the K/V of the prefix) at this
machine's read bandwidth (a torch sum over 256 MB of fp32 at the same thread count), and the multiply-adds it
must do. The first table: medians over --repeats steps, the paths interleaved step by step; the breakdowns: means
(so that the parts add up to the step); every number in ms per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from sglang_ext import kernels
from sglang_ext.attention import causal_mask, plan_attention, prefix_and_tree_mask
from sglang_ext.models import load_target

Q8_PHASES = ("setup", "norm", "qkv+rope", "attention", "o", "norm", "gate/up+silu", "down", "final norm")


def bandwidth_gbs(threads: int) -> float:
    x = torch.ones(64 * 1024 * 1024)  # 256 MB
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def floor(model, prefix: int, rows: int, gbs: float) -> dict:
    c = model.cfg
    layer_bytes = sum(w.moa_packed[1].numel() for lw in model.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
    head_bytes = model.lm_head.moa_packed[1].numel()
    kv_bytes = 2 * c.num_layers * (prefix + rows) * c.num_kv_heads * c.head_dim * 4
    layer_params = sum(w.numel() for lw in model.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
    macs = rows * (layer_params + model.lm_head.numel() + 2 * c.num_layers * (prefix + rows) * c.num_heads * c.head_dim)
    total = layer_bytes + head_bytes + kv_bytes
    return {"MB": total / 1e6, "kv MB": kv_bytes / 1e6, "GMAC": macs / 1e9, "ms": total / gbs / 1e6}


class Step:
    """rows new tokens (a chain, as a verify tree's deepest path) after a prefix of random tokens."""

    def __init__(self, model, prefix: int, rows: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.model, self.kv = model, model.new_kv_pool(prefix + rows + 8)
        cols = torch.arange(1, prefix + 1)
        ids = torch.randint(3, model.cfg.vocab_size, (prefix,), generator=g)
        model.forward(ids, torch.arange(prefix), cols, plan_attention([cols], [causal_mask(prefix, 0)]), self.kv)
        self.slots = torch.arange(prefix + 1, prefix + 1 + rows)
        self.ids = torch.randint(3, model.cfg.vocab_size, (rows,), generator=g)
        self.pos = torch.arange(prefix, prefix + rows)
        mask = prefix_and_tree_mask(torch.tril(torch.ones(rows, rows, dtype=torch.bool)), prefix)
        self.plan = plan_attention([torch.cat([cols, self.slots])], [mask])

    def run(self) -> tuple[float, float]:
        """(forward ms, head ms)"""
        t0 = time.perf_counter()
        out = self.model.forward(self.ids, self.pos, self.slots, self.plan, self.kv)
        t1 = time.perf_counter()
        self.model.logits(out.hidden, fp32=False)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    @torch.inference_mode()
    def fp32_parts(self) -> dict[str, float]:
        """The fp32 per-layer path (LlamaModel._layer_forward_ops) with each op timed."""
        m, c, parts = self.model, self.model.cfg, defaultdict(float)

        def timed(kind, f, *a):
            t0 = time.perf_counter()
            out = f(*a)
            parts[kind] += (time.perf_counter() - t0) * 1e3
            return out

        x = m.embed[self.ids]
        cos, sin = m.rope(self.pos)
        lin = kernels.linear_rows if m._rows_kernel and x.shape[0] <= kernels.SMALL_ROWS else kernels.linear
        for i, lw in enumerate(m.layers):
            h = timed("glue", kernels.rms_norm, x, lw.input_norm, c.rms_norm_eps)
            qkv = timed("matmuls", lin, h, lw.qkv)
            k, v = self.kv.k[i], self.kv.v[i]
            q = timed(
                "glue", kernels.rope_store, qkv, cos[:, 0], sin[:, 0], k, v, self.slots, c.num_heads, c.num_kv_heads
            )
            a = timed("attention", m.attention, q, k, v, self.plan, m.scale)
            o = timed("matmuls", lin, a.reshape(x.shape[0], -1), lw.o)
            x, h = timed("glue", kernels.add_rms_norm, x, o, lw.post_norm, c.rms_norm_eps)
            gu = timed("matmuls", lin, h, lw.gate_up)
            mid = timed("glue", kernels.silu_mul, gu)
            d = timed("matmuls", lin, mid, lw.down)
            x = timed("glue", torch.add, x, d)
        timed("glue", kernels.rms_norm, x, m.norm, c.rms_norm_eps)
        return parts


def row(label: str, cells: list) -> str:
    return "| " + " | ".join([label, *(f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells)]) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=400, help="tokens already in the KV cache")
    ap.add_argument("--rows", default="1,2,4,8,16", help="new tokens per step (1: decode; more: a verify tree)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.q8_unavailable() is not None:
        raise SystemExit(f"q8 unavailable here: {kernels.q8_unavailable()}")
    q8 = load_target("smollm2", dtype="q8").model
    fp32 = load_target("smollm2", dtype="float32").model
    gbs = bandwidth_gbs(args.threads)
    print(f"{args.threads} threads, prefix {args.prefix}, read bandwidth {gbs:.1f} GB/s (torch sum over 256 MB)\n")
    print("| rows | bytes read, MB (K/V) | GMAC | floor ms | q8 step | float32 step | q8 × float32 |")
    print("|---|---|---|---|---|---|---|")
    detail = []
    for rows in (int(r) for r in args.rows.split(",")):
        steps = {"q8": Step(q8, args.prefix, rows), "float32": Step(fp32, args.prefix, rows)}
        times = {k: [] for k in steps}
        for s in steps.values():
            s.run()
        q8.q8.set_profile(True)
        q8.q8.profile()
        for _ in range(args.repeats):
            for k, s in steps.items():
                times[k].append(s.run())
        phases = [p / args.repeats for p in q8.q8.profile()]
        q8.q8.set_profile(False)
        parts = defaultdict(list)
        for _ in range(args.repeats):
            for kind, ms in steps["float32"].fp32_parts().items():
                parts[kind].append(ms)
        med = {k: (statistics.median(f for f, _ in t), statistics.median(h for _, h in t)) for k, t in times.items()}
        mean = {k: (statistics.fmean(f for f, _ in t), statistics.fmean(h for _, h in t)) for k, t in times.items()}
        fl = floor(q8, args.prefix, rows, gbs)
        q8_ms, fp_ms = sum(med["q8"]), sum(med["float32"])
        print(
            row(
                str(rows),
                [
                    f"{fl['MB']:.1f} ({fl['kv MB']:.1f})",
                    f"{fl['GMAC']:.2f}",
                    fl["ms"],
                    q8_ms,
                    fp_ms,
                    f"{fp_ms / q8_ms:.2f}×",
                ],
            )
        )
        fparts = {k: statistics.fmean(v) for k, v in parts.items()}
        detail.append((rows, mean, phases, fparts))
    print("\nq8, one call per step (phases summed over the layers; each includes its barrier):\n")
    print(
        "| rows | matmuls (qkv, o, gate/up, down) | attention | norms, RoPE, SiLU, quantise | setup + Python | head |"
    )
    print("|---|---|---|---|---|---|")
    for rows, med, ph, _ in detail:
        matmul = ph[2] + ph[4] + ph[6] + ph[7]  # with RoPE / residual / SiLU fused into them
        glue = ph[1] + ph[5] + ph[8]
        python = med["q8"][0] - sum(ph)
        print(row(str(rows), [matmul, ph[3], glue, ph[0] + python, med["q8"][1]]))
    print("\nfloat32 on the kernels, layer by layer (each op timed; the rest is Python and dispatch between them):\n")
    print("| rows | matmuls | attention | glue ops | between the ops | head |")
    print("|---|---|---|---|---|---|")
    for rows, med, _, fp in detail:
        between = med["float32"][0] - sum(fp.values())
        print(row(str(rows), [fp["matmuls"], fp["attention"], fp["glue"], between, med["float32"][1]]))


if __name__ == "__main__":
    main()
