"""Same-run A/B of the CPU kernels: SmolLM2 forwards of 1-64 rows (decode and verify sizes)
with our kernel and without, interleaved so machine drift hits both alike.

    .venv/bin/python scripts/kernel-ab.py [--threads 2] [--prefix 400] [--repeats 20]
    .venv/bin/python scripts/kernel-ab.py --baseline fd4c241   # against the linear kernel of another commit
    .venv/bin/python scripts/kernel-ab.py --attention          # the attention kernel against torch's
    .venv/bin/python scripts/kernel-ab.py --packed             # GGUF block weights against their fp32 copy
    .venv/bin/python scripts/kernel-ab.py --packed --baseline a3d6397   # the packed kernel against another commit's
    .venv/bin/python scripts/kernel-ab.py --layer-ops          # the layer glue ops against the torch ops
                                                               # (GGUF blocks on both sides)
    .venv/bin/python scripts/kernel-ab.py --mkl                # the serving default against MKL for every row count
    .venv/bin/python scripts/kernel-ab.py --unchecked-rows     # the layer's matmuls without linear()'s per-call checks,
                                                               # against linear()

By default the B side is torch's F.linear for the linear layers; with --baseline REV it is the linear
kernel source at git revision REV (compiled here under another op namespace); with --attention it
is the torch attention backend (linear kernel on both sides). The other kernel is the same on both sides.
Except with --packed (A: the kernel reading the GGUF blocks; B: the kernel reading the fp32 weights,
or with --baseline REV the GGUF-block kernel at REV), --layer-ops (both sides read the GGUF blocks,
the serving default; A runs a layer's norms, RoPE and SiLU on cpu_layer_ops.cpp, B on torch ops),
--unchecked-rows (GGUF blocks and layer ops on both sides; A calls the kernel directly, B via linear()),
--mkl (A: the serving default, the kernel on the GGUF blocks up to SMALL_ROWS rows; B: F.linear on the fp32 weights),
both sides read the fp32 weights.
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_ext import kernels
from sglang_ext.attention import (
    causal_mask,
    plan_attention,
    prefix_and_tree_mask,
    tree_attention_cpu,
    tree_attention_torch,
)
from sglang_ext.models import load_target


def build_baseline(rev: str):
    """The linear kernel ops as of git revision `rev`, compiled into its own namespace (moa_baseline) with
    setup.py's extension settings."""
    root = Path(__file__).resolve().parent.parent
    ext = runpy.run_path(str(root / "setup.py"), run_name="kernel_ab")["cpu_kernel_extensions"]()
    if not ext:
        raise SystemExit("setup.py builds no CPU kernel on this machine")
    ext = ext[0]
    linear_src = next(f for f in ext.sources if f.endswith("cpu_linear.cpp"))
    src = subprocess.run(
        ["git", "show", f"{rev}:{linear_src}"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    build = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    (build / "baseline.cpp").write_text(src.replace("moa_cpu", "moa_baseline"))
    cmd = [
        "g++",
        "-shared",
        "-fPIC",
        *ext.extra_compile_args,
        *(f"-I{p}" for p in ext.include_dirs),
        f"-I{root / Path(linear_src).parent}",
        *(f"-L{p}" for p in ext.library_dirs),
        *(f"-Wl,-rpath,{p}" for p in ext.runtime_library_dirs),
        str(build / "baseline.cpp"),
        "-o",
        str(build / "baseline.so"),
        *ext.extra_link_args,
        *(f"-l{l}" for l in ext.libraries),
    ]
    subprocess.run(cmd, check=True)
    torch.ops.load_library(str(build / "baseline.so"))
    return torch.ops.moa_baseline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=400, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", default="1,2,4,6,8,16,32,64")
    ap.add_argument(
        "--baseline", metavar="REV", help="compare with the linear kernel at this git revision instead of F.linear"
    )
    ap.add_argument(
        "--attention", action="store_true", help="compare the attention kernel with torch's attention instead"
    )
    ap.add_argument(
        "--packed", action="store_true", help="compare the kernel reading GGUF blocks with the one reading fp32 weights"
    )
    ap.add_argument(
        "--layer-ops",
        action="store_true",
        help="compare the layer glue ops (norms, RoPE + K/V store, SiLU) with torch's ops",
    )
    ap.add_argument(
        "--mkl",
        action="store_true",
        help=(
            "the serving default (kernel on GGUF blocks up to SMALL_ROWS rows) against MKL (F.linear on the fp32 "
            "weights) for every row count"
        ),
    )
    ap.add_argument(
        "--unchecked-rows",
        action="store_true",
        help="on the layer ops, compare the layer matmuls without linear()'s per-call checks with linear()",
    )
    args = ap.parse_args()
    if not kernels.AVAILABLE:
        raise SystemExit(f"kernel unavailable: {kernels.UNAVAILABLE}")
    current, current_packed = kernels.linear_small, kernels.linear_packed
    baseline = build_baseline(args.baseline) if args.baseline else None
    current_rope = kernels.rope_store
    small_rows = kernels.SMALL_ROWS
    if args.layer_ops and current_rope is None:
        raise SystemExit("layer ops unavailable (MOA_SERVE_LAYER_OPS=0 or an old build)")
    b_name = (
        "MKL"
        if args.mkl
        else "linear() with checks"
        if args.unchecked_rows
        else "torch layer ops"
        if args.layer_ops
        else "torch attention"
        if args.attention
        else f"kernel@{args.baseline}"
        if baseline
        else "fp32 weights"
        if args.packed
        else "torch"
    )
    torch.set_num_threads(args.threads)
    packed_default = kernels.PACKED
    kernels.PACKED = packed_default and (
        args.layer_ops or args.unchecked_rows or args.mkl
    )  # else fp32 weights on both sides unless --packed
    if args.packed and not packed_default:
        raise SystemExit("packed weights unavailable (MOA_SERVE_PACKED_WEIGHTS=0?)")
    model = load_target("smollm2", dtype="float32").model
    rows_default = model._rows_kernel
    if args.unchecked_rows and not (rows_default and current_rope is not None):
        raise SystemExit(
            "the unchecked small-rows path is unavailable (layer ops off, or a model that does not fit the kernel)"
        )
    p = args.prefix
    kv = model.new_kv_pool(p + 256)
    prefix = torch.arange(1, p + 1)
    model.forward(
        torch.randint(0, model.cfg.vocab_size, (p,)),
        torch.arange(p),
        prefix,
        plan_attention([prefix], [causal_mask(p, 0)]),
        kv,
    )
    print(f"| rows | kernel ms | {b_name} ms | kernel speedup |\n|---|---|---|---|")
    for n in (int(x) for x in args.rows.split(",")):
        new = torch.arange(p + 1, p + 1 + n)
        plan = plan_attention(
            [torch.cat([prefix, new])], [prefix_and_tree_mask(torch.tril(torch.ones(n, n, dtype=torch.bool)), p)]
        )
        ids, pos = torch.randint(0, model.cfg.vocab_size, (n,)), torch.arange(p, p + n)
        times = {True: [], False: []}
        for i in range(args.repeats + 2):
            for on in (True, False):
                if args.mkl:
                    kernels.SMALL_ROWS = small_rows if on else 0
                elif args.unchecked_rows:
                    model._rows_kernel = on
                elif args.layer_ops:
                    kernels.rope_store = current_rope if on else None
                elif args.attention:
                    model.attention = tree_attention_cpu if on else tree_attention_torch
                elif args.packed and baseline:
                    kernels.PACKED, kernels.linear_packed = True, current_packed if on else baseline.linear_packed
                elif args.packed:
                    kernels.PACKED = on
                else:
                    kernels.linear_small = (
                        current if on else baseline.linear_small if baseline else (lambda x, w: F.linear(x, w))
                    )
                t0 = time.perf_counter()
                out = model.forward(ids, pos, new, plan, kv)
                model.logits(out.hidden, fp32=False)
                if i >= 2:  # warm-up
                    times[on].append(time.perf_counter() - t0)
        kernels.linear_small, kernels.linear_packed, model.attention, kernels.rope_store, model._rows_kernel = (
            current,
            current_packed,
            tree_attention_cpu,
            current_rope,
            rows_default,
        )
        kernels.SMALL_ROWS = small_rows
        on, off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"| {n} | {on:.1f} | {off:.1f} | {off / on:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
