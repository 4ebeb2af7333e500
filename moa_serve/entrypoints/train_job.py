"""`python -m moa_serve.entrypoints.train_job ...`: `moa-serve train job` where only torch is installed (what a GPU
machine has): the same flags, TrainConfig and driver (moa_serve/entrypoints/train.py, sglang_ext.training.job)."""

from __future__ import annotations

import argparse
import sys

from moa_serve.entrypoints.train import add_job_args, cmd_run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moa_serve.entrypoints.train_job", description="the drafter training job"
    )
    add_job_args(p)
    p.set_defaults(draft_type="job")
    return cmd_run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
