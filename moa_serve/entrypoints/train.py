"""`moa-serve train <command>`: flags -> TrainConfig -> sglang_ext.training.job.run, the one driver.

    moa-serve train eagle3 --target smollm2 --data sharegpt --out runs/eagle3 [--resume]
    moa-serve train moa --tli 1 --target smollm2 --data sharegpt --out runs/moa-tli1 [--resume]
    moa-serve train medusa --data runs/shards-distill --out runs/medusa [--resume]
    moa-serve train job --shards runs/shards --out runs/job       EAGLE-3, MoA TLI=0 and 1 on one target run
    moa-serve train pack --data sharegpt --out runs/shards        token shards (what a GPU job carries)
    torchrun --standalone --nproc-per-node N -m moa_serve.entrypoints.cli train ...      data parallel over N ranks

Every training command takes the same flags (the run's TrainConfig) and differs in its head and defaults.
Wiring (moa_serve/entrypoints/cli.py): `add_train_parser(sub)` in build_parser and `handlers["train"] = cmd_train`.
Also runnable as `python -m moa_serve.entrypoints.train train eagle3 ...`.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from sglang_ext.models.loader import ModelLoadError
from sglang_ext.training.config import (
    HEADS,
    Eagle3Options,
    MedusaOptions,
    MoAOptions,
    TrainConfig,
    TrainError,
    config_fields,
)

# the defaults of one head trained alone (CPU-sized) and of the job (several heads on a GPU)
HEAD_DEFAULTS = {"num_examples": 2000, "threads": 2}
JOB_DEFAULTS = {
    "tokens_per_batch": 32768,
    "draft_vocab_size": 8192,
    "lr": 1e-3,
    "warmup_ratio": 0.03,
    "log_every": 20,
    "time_budget_min": 7.0,
    "max_steps": 1_000_000,
    "holdout": 0.005,
    "distill_repeat": 3,
    "keep_checkpoints": 1,
    "no_progress": True,
}
SMOKE_OUT = "runs/smoke"


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of every training command: one TrainConfig field each."""
    p.add_argument("--target", default="smollm2", help="'smollm2' or a local HF Llama / Qwen2 / Mistral directory")
    p.add_argument("--target-gguf", default=None, help="a GGUF file of the target (converted once into --cache)")
    p.add_argument("--cache", default="/tmp/moa-serve-job-cache", help="where --target-gguf is converted")
    p.add_argument(
        "--target-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="dtype of the (frozen) target run (auto: as for serving: fp32 on CPUs with our kernels, bf16 on GPUs)",
    )
    _add_data_args(p)
    _add_schedule_args(p)
    _add_output_args(p)
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the target and the heads train (auto: CUDA when present; bf16 target and autocast there; under "
        "torchrun each rank takes cuda:<local rank>)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast around the heads (default: on GPUs and on CPUs with AMX, where it is faster)",
    )
    p.add_argument(
        "--init-from",
        default=None,
        help="start from these heads' weights and draft vocab (<dir>/<head>, or <dir> itself for one head; 'shipped': "
        "the drafters shipped for the target): fine-tuning, a fresh optimizer and LR schedule",
    )
    p.add_argument(
        "--smoke", action="store_true", help="small random target, tiny batches, a few steps (a CPU check of the run)"
    )


def _add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        "--shards",
        dest="data",
        action="append",
        default=None,
        help="'sharegpt', a .json/.jsonl conversation file or a token shard directory (`moa-serve train pack`); "
        "repeatable",
    )
    p.add_argument(
        "--num-examples", type=int, default=None, help="training examples at most (conversations tokenised per file)"
    )
    p.add_argument("--max-examples", type=int, default=None, help="at most this many examples (windows) per source")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per example (longer ones are cut)")
    p.add_argument(
        "--tokens-per-batch", type=int, default=4096, help="padded tokens per global batch (split over the ranks)"
    )
    p.add_argument("--draft-vocab-size", type=int, default=16384, help="target tokens the heads score (0: all)")
    p.add_argument(
        "--vocab-examples",
        type=int,
        default=0,
        help="conversations whose assistant tokens pick the draft vocab (default: the training set)",
    )
    p.add_argument(
        "--distill-repeat", type=int, default=1, help="the target's own answers (distill:* sources) per epoch"
    )
    p.add_argument("--holdout", type=float, default=0.0, help="fraction of each source held out and scored at the end")


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    p.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="end at this step while keeping the LR schedule of the full run (matched ablations)",
    )
    p.add_argument(
        "--time-budget-min",
        type=float,
        default=None,
        help="stop after this much training time; the LR schedule follows time (for shared machines)",
    )
    p.add_argument(
        "--deadline-min",
        type=float,
        default=None,
        help="wall time of the whole run: training stops early enough to export and score by then",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.015)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help=f"run directory (required; --smoke: {SMOKE_OUT})")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="continue from the last checkpoint of DIR (a run or checkpoint directory; default --out): heads, "
        "optimizer, LR schedule, data position, random states, tokens seen",
    )
    p.add_argument("--save-every-min", type=float, default=5.0, help="a checkpoint at least this often")
    p.add_argument("--save-every-steps", type=int, default=None, help="also a checkpoint every this many steps")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="the newest this many are kept")
    p.add_argument("--log-every", type=int, default=1, help="steps between metric reads (one host sync each)")
    p.add_argument("--pack", default=None, help="also write heads.tar.partNN (<= 15 MiB each) here")
    p.add_argument(
        "--no-progress", action="store_true", help="no tqdm bar (metrics still go to metrics.jsonl/TensorBoard)"
    )


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    t = subparsers.add_parser("train", help="train drafters (EAGLE-3, MoA, Medusa) with the target run online")
    kinds = t.add_subparsers(dest="draft_type", required=True)
    _add_eagle3_parser(kinds)
    _add_moa_parser(kinds)
    _add_medusa_parser(kinds)
    add_job_parser(kinds)
    _add_pack_parser(kinds)
    return t


def add_job_parser(kinds) -> argparse.ArgumentParser:
    j = kinds.add_parser("job", help="several heads (EAGLE-3, MoA TLI 0/1) trained together on one target run")
    add_job_args(j)
    return j


def add_job_args(j: argparse.ArgumentParser) -> None:
    add_run_args(j)
    j.add_argument(
        "--heads",
        default=",".join(HEADS),
        help=(
            "comma list of eagle3, medusa, moa-tli<N>; a head may carry its own options, <head>@key=value[@...] "
            "(e.g. moa-tli1@lambda_feat=0.3@lr=3e-4): recipe variants on the same batches"
        ),
    )
    j.set_defaults(**JOB_DEFAULTS, train_fn=cmd_run)


def _add_eagle3_parser(kinds) -> None:
    e = kinds.add_parser("eagle3", help="EAGLE-3 draft head (SpecForge/SGLang checkpoint format)")
    add_run_args(e)
    e.add_argument(
        "--aux-layers", default=None, help="comma-separated target layers whose outputs are fused (default 1,L/2-1,L-4)"
    )
    e.add_argument("--ttt-length", type=int, default=7)
    e.add_argument("--ttt-decay", type=float, default=0.8)
    e.add_argument(
        "--init-head-from-target",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start lm_head/norm from the target's rows",
    )
    e.set_defaults(**HEAD_DEFAULTS, train_fn=cmd_run)


def _add_moa_parser(kinds) -> None:
    m = kinds.add_parser("moa", help="Mixture-of-Attentions drafter (LSA + SA + CA, optional target-layer inference)")
    add_run_args(m)
    d = MoAOptions()
    m.add_argument("--tli", type=int, default=0, help="target layers run on the draft feature (0, 1, 3, ...)")
    m.add_argument("--lambda-kl", type=float, default=d.lambda_kl, help="weight of KL(target || draft) (HEBO: 0.1)")
    m.add_argument("--lambda-feat", type=float, default=d.lambda_feat, help="weight of the SmoothL1 feature term")
    m.add_argument("--min-gap", type=int, default=d.min_gap, help="verification points every K in [min, max] tokens")
    m.add_argument("--max-gap", type=int, default=d.max_gap)
    m.add_argument(
        "--staircase-ramp",
        type=float,
        default=d.staircase_ramp,
        help="fraction of training over which the SA staircase probability ramps up",
    )
    m.add_argument(
        "--staircase-max",
        type=float,
        default=d.staircase_max,
        help="final SA staircase probability (1: the drafter's SA sees only the verified prefix + itself)",
    )
    m.add_argument(
        "--no-lsa",
        action="store_true",
        help="ablation: CA reads the target's last-layer output instead of LSA over all layers' K/V",
    )
    m.add_argument(
        "--position-decay",
        type=float,
        default=d.position_decay,
        help="a row at draft depth d weighs this**d in the loss (1: every depth alike)",
    )
    m.add_argument(
        "--sa-layers", type=int, default=d.sa_layers, help="self-attention layers (ablation: the drafter serves 1)"
    )
    m.set_defaults(**HEAD_DEFAULTS, train_fn=cmd_run)


def _add_medusa_parser(kinds) -> None:
    m = kinds.add_parser(
        "medusa", help="Medusa-1 heads over the target's last hidden state (the target's lm_head shared)"
    )
    add_run_args(m)
    m.add_argument("--num-heads", type=int, default=4, help="heads (head k drafts tree depth k+1)")
    m.add_argument("--decay", type=float, default=0.8, help="head k's loss weight is decay**k (Medusa: 0.8)")
    m.set_defaults(**HEAD_DEFAULTS, draft_vocab_size=8192, train_fn=cmd_run)


def _add_pack_parser(kinds) -> None:
    k = kinds.add_parser(
        "pack", help="pack conversations and the target's answers into token shards (what a GPU job carries)"
    )
    k.add_argument("--target", default="smollm2", help="'smollm2' or a local HF Llama/Qwen directory (its tokenizer)")
    k.add_argument(
        "--data",
        action="append",
        required=True,
        help=(
            "'sharegpt', a .json/.jsonl file, or a directory of the target's answers (../shared/data/distill format); "
            "repeatable"
        ),
    )
    k.add_argument("--out", required=True, help="shard directory (manifest.json + shard-*.npz)")
    k.add_argument("--shard-tokens", type=int, default=4_000_000, help="tokens per shard file")
    k.set_defaults(train_fn=pack_data)


def cmd_train(args) -> int:
    return args.train_fn(args)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of a training command's flags."""
    given = vars(args)
    fields = {k: given[k] for k in config_fields() if k in given}
    fields["data"] = tuple(args.data or ())
    fields["progress"] = not args.no_progress
    fields["out"] = args.out or (SMOKE_OUT if args.smoke else None)
    if fields["out"] is None:
        raise TrainError("--out is required")
    kind = args.draft_type
    if kind == "job":
        fields["heads"] = tuple(h for h in args.heads.split(",") if h)
    elif kind == "moa":
        fields["heads"] = (f"moa-tli{args.tli}",)
        moa = {k: given[k] for k in MoAOptions.__dataclass_fields__}
        fields["moa"] = MoAOptions(**moa)
    elif kind == "eagle3":
        fields["heads"] = ("eagle3",)
        aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
        fields["eagle3"] = Eagle3Options(args.ttt_length, args.ttt_decay, aux, args.init_head_from_target)
    else:
        fields["heads"] = (kind,)
        fields["medusa"] = MedusaOptions(args.num_heads, args.decay)
    return TrainConfig(**fields)


def cmd_run(args: argparse.Namespace) -> int:
    """Inputs the run cannot use (bad flags, data, target, device) are one line and exit 2; a run that fails
    while training prints its traceback (a GPU run's log is all there is) and exits 1."""
    from sglang_ext.training.job import run

    prog = f"moa-serve train {args.draft_type}"
    try:
        run(train_config(args))
    except (ValueError, FileNotFoundError, ModelLoadError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def _log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pack_data(args) -> int:
    from sglang_ext.models.loader import load_tokenizer, resolve_target
    from sglang_ext.training.shards import distill_examples, pack, sharegpt_examples

    tok = load_tokenizer(resolve_target(args.target))
    sources = {}
    for src in args.data:
        if src != "sharegpt" and Path(src).is_dir():
            sources[f"distill:{Path(src).name}"] = distill_examples(src, excluded_distill_prompts(tok, src))
        else:
            sources[src if src == "sharegpt" else Path(src).name] = sharegpt_examples(tok, src)
    manifest = pack(args.out, sources, len(tok), args.shard_tokens, meta={"target": args.target, "data": args.data})
    _log(
        f"{manifest['examples']} examples, {manifest['tokens']} tokens ({manifest['assistant_tokens']} assistant) in "
        f"{len(manifest['shards'])} shards -> {args.out}"
    )
    return 0


def excluded_distill_prompts(tokenizer, directory: str) -> set[int]:
    """ShareGPT record indices of distill prompts whose user turn is an eval prompt."""
    import numpy as np

    from sglang_ext.training.data import eval_prompts

    evals = eval_prompts()
    z = np.load(Path(directory) / "sharegpt-prompts.npz")
    out = set()
    for k in range(len(z["offsets"]) - 1):
        text = tokenizer.decode(z["ids"][z["offsets"][k] : z["offsets"][k + 1]].tolist())
        user = text.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0].strip()
        if user in evals:
            out.add(int(z["src"][k]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moa-serve")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return cmd_train(args)


if __name__ == "__main__":
    sys.exit(main())
