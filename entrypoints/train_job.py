"""`moa-serve train job` (also `python -m entrypoints.train_job`, which needs only torch: what a GPU
machine has): flags -> JobConfig -> sglang_ext.training.job.run."""

from __future__ import annotations

import argparse
import sys
import traceback

from sglang_ext.models import resolve_device
from sglang_ext.training.job import HEADS, JobConfig, JobError, run


def add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", required=True, help="token shard directory (moa-serve train pack)")
    p.add_argument("--target", default="smollm2", help="'smollm2' or a local HF directory")
    p.add_argument("--target-gguf", default=None, help="a GGUF file of the target (converted once into --cache)")
    p.add_argument("--cache", default="/tmp/moa-serve-job-cache")
    p.add_argument("--out", required=True)
    p.add_argument("--pack", default=None, help="also write heads.tar.partNN (<= 15 MiB each) here")
    p.add_argument("--heads", default=",".join(HEADS), help="comma list of " + ",".join(HEADS))
    p.add_argument(
        "--init-from", default=None, help="fine-tune: start each head from <dir>/<head> (its weights and draft vocab)"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--time-budget-min", type=float, default=7.0, help="training time; the LR schedule follows it")
    p.add_argument(
        "--deadline-min",
        type=float,
        default=None,
        help="wall time of the whole job: training stops early enough to export and score by then",
    )
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--tokens-per-batch", type=int, default=32768)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--distill-repeat", type=int, default=3)
    p.add_argument("--max-examples", type=int, default=None, help="at most this many examples (windows) per source")
    p.add_argument("--holdout", type=float, default=0.005, help="fraction of each source held out for the final scores")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="small random target, tiny batches, a few steps (CPU test)")


def job_config(args: argparse.Namespace) -> JobConfig:
    fields = {k: v for k, v in vars(args).items() if k in JobConfig.__dataclass_fields__}
    fields["heads"] = tuple(h for h in args.heads.split(",") if h)
    return JobConfig(**fields)


def cmd_job(args: argparse.Namespace) -> int:
    """Inputs the job cannot run (a bad --device, JobError) are one line and exit 2; a job that fails
    while running prints its traceback (a GPU run's log is all there is) and exits 1."""
    try:
        job = job_config(args)
        resolve_device(job.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(job)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m entrypoints.train_job", description="the drafter training job")
    add_job_args(p)
    return cmd_job(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
