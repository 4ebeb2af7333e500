"""`python -m moa_serve.entrypoints.gpu_job`: the GPU engine job (moa_serve/benchmarks/gpu_job/) from flags.

    python -m moa_serve.entrypoints.gpu_job --target-gguf /tmp/moa-target/SmolLM2-135M-Instruct.Q4_1.gguf \
        --device cuda --out DIR
    python -m moa_serve.entrypoints.gpu_job --smoke --device cpu --out DIR   # a small random target: the CPU suite

Imports only what a lent GPU machine has (torch, transformers, numpy, pytest; see ../shared/notes/gpu.md);
scripts/gpu-engine-job.sh stages the target and runs it there. Writes DIR/results.json and DIR/table.md.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from moa_serve.benchmarks.gpu_job import DEFAULT_METHODS, GpuJobConfig, run_job


def _ints(text: str) -> tuple[int, ...]:
    sizes = tuple(int(x) for x in text.split(",") if x.strip())
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,64, got {text!r}")
    return sizes


def _list(text: str, sep: str = ",") -> tuple[str, ...]:
    return tuple(x for x in text.split(sep) if x and x != "none")


def parser() -> argparse.ArgumentParser:
    d = GpuJobConfig(out="")
    p = argparse.ArgumentParser(prog="python -m moa_serve.entrypoints.gpu_job", description="the GPU engine job")
    p.add_argument("--out", required=True, help="directory for results.json, table.md, pytest.log")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--target-gguf", default=None, help="the target's GGUF (converted once into --cache; needs gguf)")
    src.add_argument("--model", default=d.model, help="without --target-gguf: 'smollm2' or a local HF directory")
    src.add_argument("--smoke", action="store_true", help="small random target, tiny sizes (the CPU test suite)")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--methods",
        default=";".join(DEFAULT_METHODS),
        help="semicolon list of drafters, each optionally with a tree (eagle3:6,8,48); vanilla always runs",
    )
    p.add_argument("--batch-sizes", type=_ints, default=d.batch_sizes, help="batch sweep sizes (default 1,8,64)")
    p.add_argument(
        "--throughput-batch-sizes",
        type=_ints,
        default=d.throughput_batch_sizes,
        help="vanilla static-batch throughput sizes (default 64,256)",
    )
    p.add_argument(
        "--profile-methods",
        default=",".join(d.profile_methods),
        help="drafters whose steady-state step is profiled beside vanilla's ('none': the first one loaded)",
    )
    p.add_argument("--identity-batch-sizes", type=_ints, default=d.identity_batch_sizes)
    p.add_argument("--identity-prompts", type=int, default=d.identity_prompts)
    p.add_argument("--eval-sets", default=",".join(d.eval_sets), help="comma list (sglang_ext/evalsets.py)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="prompts per eval set at batch size 1")
    p.add_argument("--sweep-min-prompts", type=int, default=d.sweep_min_prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument(
        "--deadline-min",
        type=float,
        default=d.deadline_min,
        help="wall time of the whole job (target conversion included): no measurement starts that would not "
        "fit; the default fits one 10-minute device command with the staging before it",
    )
    p.add_argument("--gpu-tests", default=",".join(d.gpu_tests), help="paths for `pytest -m gpu` ('none': skip)")
    p.add_argument("--cache", default=d.cache, help="where a GGUF is converted to")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    return p


def job_config(args: argparse.Namespace) -> GpuJobConfig:
    return GpuJobConfig(
        out=args.out,
        target_gguf=args.target_gguf,
        model=args.model,
        smoke=args.smoke,
        device=args.device,
        methods=_list(args.methods, ";"),
        batch_sizes=args.batch_sizes,
        throughput_batch_sizes=args.throughput_batch_sizes,
        profile_methods=_list(args.profile_methods),
        identity_batch_sizes=args.identity_batch_sizes,
        identity_prompts=args.identity_prompts,
        eval_sets=_list(args.eval_sets),
        num_prompts=args.num_prompts,
        sweep_min_prompts=args.sweep_min_prompts,
        max_new_tokens=args.max_new_tokens,
        deadline_min=args.deadline_min,
        gpu_tests=_list(args.gpu_tests),
        cache=args.cache,
        commit=args.commit,
    )


def main(argv: list[str] | None = None) -> int:
    """Prints the table; a job that fails before writing results prints its traceback (a device
    command's output is all there is) and exits 1."""
    args = parser().parse_args(argv)
    try:
        payload = run_job(job_config(args))
    except Exception:
        traceback.print_exc()
        return 1
    from moa_serve.benchmarks.gpu_job import markdown

    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
