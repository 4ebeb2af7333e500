"""`moa-serve train <type>`: shared argument set and the EAGLE-3 / MoA entry points.

    moa-serve train eagle3 --target smollm2 --data sharegpt --out runs/eagle3 [--resume]
    moa-serve train moa --tli 1 --target smollm2 --data sharegpt --out runs/moa-tli1 [--resume]
    moa-serve train medusa --data runs/shards-distill --out runs/medusa [--resume]

Wiring (entrypoints/cli.py): `add_train_parser(sub)` in build_parser and `handlers["train"] = cmd_train`.
Also runnable as `python -m entrypoints.train train eagle3 ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2", help="'smollm2' or a local HF Llama/Qwen directory")
    p.add_argument(
        "--target-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="dtype of the (frozen) target run (auto: as for serving: fp32 on CPUs with our kernels)",
    )
    p.add_argument(
        "--data",
        action="append",
        required=True,
        help="'sharegpt', a .json/.jsonl file or a token shard directory (`moa-serve train pack`); repeatable",
    )
    p.add_argument("--out", required=True, help="output directory (checkpoints, logs, TensorBoard)")
    p.add_argument("--num-examples", type=int, default=2000, help="conversations to train on (seeded sample)")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per conversation (longer ones are truncated)")
    p.add_argument("--tokens-per-batch", type=int, default=4096, help="padded tokens per optimizer step")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    p.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="end at this step while keeping the LR schedule of the full run (matched ablations)",
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.015)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--time-budget-min",
        type=float,
        default=None,
        help="stop after this much training time; the LR schedule follows time (for shared machines)",
    )
    p.add_argument("--save-every-min", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the target and the draft train (auto: CUDA when present; bf16 target and autocast there)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from <out>/latest")
    p.add_argument(
        "--init-from",
        default=None,
        help=(
            "start from this checkpoint's weights and draft vocab (fine-tuning, e.g. on `moa-serve distill` data); a "
            "fresh optimizer and LR schedule"
        ),
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no tqdm bar (metrics still go to metrics.jsonl/TensorBoard)"
    )


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    t = subparsers.add_parser("train", help="train a drafter (eagle3) on conversations with the target run online")
    kinds = t.add_subparsers(dest="draft_type", required=True)
    _add_eagle3_parser(kinds)
    _add_moa_parser(kinds)
    _add_medusa_parser(kinds)
    _add_pack_parser(kinds)
    from entrypoints.train_job import add_job_args, cmd_job

    j = kinds.add_parser("job", help="EAGLE-3 and MoA TLI 0/1 trained together on one target run (the GPU job)")
    add_job_args(j)
    j.set_defaults(train_fn=cmd_job)
    return t


def _add_eagle3_parser(kinds) -> None:
    e = kinds.add_parser("eagle3", help="EAGLE-3 draft head (SpecForge/SGLang checkpoint format)")
    _add_common(e)
    e.add_argument("--draft-vocab-size", type=int, default=16384)
    e.add_argument(
        "--vocab-examples",
        type=int,
        default=0,
        help="conversations whose assistant tokens pick the draft vocab (default: the training set)",
    )
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
    e.set_defaults(train_fn=train_eagle3)


def _add_moa_parser(kinds) -> None:
    m = kinds.add_parser("moa", help="Mixture-of-Attentions drafter (LSA + SA + CA, optional target-layer inference)")
    _add_common(m)
    m.add_argument("--tli", type=int, default=0, help="target layers run on the draft feature (0, 1, 3, ...)")
    m.add_argument(
        "--draft-vocab-size",
        type=int,
        default=16384,
        help="rows of the target lm_head the drafter scores (0: full vocab)",
    )
    m.add_argument(
        "--vocab-examples",
        type=int,
        default=0,
        help="conversations whose assistant tokens pick the draft vocab (default: the training set)",
    )
    # NOTE: HEBO uses 0.1 / 1.0 for Llama-3-8B; SmolLM2's residual stream is large enough that its
    # SmoothL1 term (~17 at init vs KL ~15) would swamp the KL, so our defaults weight the KL.
    m.add_argument("--lambda-kl", type=float, default=1.0, help="weight of KL(target || draft) (HEBO: 0.1)")
    m.add_argument("--lambda-feat", type=float, default=0.1, help="weight of the SmoothL1 feature term (HEBO: 1.0)")
    m.add_argument("--min-gap", type=int, default=6, help="verification points every K in [min-gap, max-gap] tokens")
    m.add_argument("--max-gap", type=int, default=14)
    m.add_argument(
        "--staircase-ramp",
        type=float,
        default=0.5,
        help="fraction of training over which the SA staircase probability ramps up",
    )
    m.add_argument(
        "--staircase-max",
        type=float,
        default=1.0,
        help="final SA staircase probability (1: the drafter's SA sees only the verified prefix + itself)",
    )
    m.add_argument(
        "--no-lsa",
        action="store_true",
        help="ablation: CA reads the target's last-layer output instead of LSA over all layers' K/V",
    )
    m.set_defaults(train_fn=train_moa)


def _add_medusa_parser(kinds) -> None:
    m = kinds.add_parser(
        "medusa", help="Medusa-1 heads over the target's last hidden state (the target's lm_head shared)"
    )
    _add_common(m)
    m.add_argument("--num-heads", type=int, default=4, help="heads (head k drafts tree depth k+1)")
    m.add_argument(
        "--draft-vocab-size",
        type=int,
        default=8192,
        help="rows of the target lm_head the heads score (0: full vocab)",
    )
    m.add_argument("--decay", type=float, default=0.8, help="head k's loss weight is decay**k (Medusa: 0.8)")
    m.set_defaults(train_fn=train_medusa)


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


# --- shared preparation -----------------------------------------------------------------------
def prepare_examples(args, tokenizer):
    """Tokenised examples, cached in <out>/examples.pt so a resumed run sees the same data."""
    from sglang_ext.training.data import Example, build_examples, eval_prompts, open_conversations

    cache = Path(args.out) / "examples.pt"
    if args.resume and cache.is_file():
        raw = torch.load(cache, weights_only=True)
        return [Example(i, m) for i, m in zip(raw["input_ids"], raw["loss_mask"])]
    exclude = eval_prompts()
    shard_dirs = [src for src in args.data if (Path(src) / "manifest.json").is_file()]
    convs = (c for src in args.data if src not in shard_dirs for c in open_conversations(src, exclude))
    exs = (
        build_examples(tokenizer, convs, args.num_examples, args.max_len, seed=args.seed)
        if len(shard_dirs) < len(args.data)
        else []
    )
    if shard_dirs:  # packed examples (eval prompts were left out when packing): a seeded sample of their windows
        import random

        from sglang_ext.training.shards import load_examples

        packed = [e for d in shard_dirs for e in load_examples(d, args.max_len)]
        random.Random(args.seed).shuffle(packed)
        exs = (exs + packed)[: args.num_examples]
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": [e.input_ids for e in exs], "loss_mask": [e.loss_mask for e in exs]}, cache)
    return exs


def vocab_counts(args, tokenizer, exs, vocab_size: int) -> torch.Tensor:
    """Assistant-token frequencies over the training examples, or over a larger seeded sample
    (--vocab-examples) so the draft vocab generalises beyond the conversations trained on."""
    from sglang_ext.training.data import build_examples, eval_prompts, open_conversations, token_counts

    if args.vocab_examples <= len(exs):
        return token_counts(exs, vocab_size)
    cache = Path(args.out) / "vocab_counts.pt"
    if cache.is_file():
        return torch.load(cache, weights_only=True)
    convs = (c for src in args.data for c in open_conversations(src, eval_prompts()))
    counts = token_counts(
        build_examples(tokenizer, convs, args.vocab_examples, args.max_len, seed=args.seed), vocab_size
    )
    torch.save(counts, cache)
    return counts


def _device(args) -> str:
    from sglang_ext.models import resolve_device

    return resolve_device(args.device)


def _log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train_eagle3(args) -> int:
    from sglang_ext.models import load_target
    from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3, vocab_from_counts
    from sglang_ext.training.eagle3 import Eagle3Task

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target = load_target(args.target, dtype=args.target_dtype, device=_device(args))
    exs = prepare_examples(args, target.tokenizer)
    counts = vocab_counts(args, target.tokenizer, exs, target.cfg.vocab_size)
    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
    if args.init_from:
        draft = load_eagle3(args.init_from, target.cfg)
        cfg, hot = draft.cfg, draft.hot_ids
    else:
        cfg = Eagle3Config.for_target(target.cfg, args.draft_vocab_size, aux)
        draft = Eagle3Draft(cfg)
        hot = vocab_from_counts(counts, cfg.draft_vocab_size)
        draft.set_vocab(hot)
    coverage = float(counts[hot].sum()) / max(1, int(counts.sum()))
    if args.init_head_from_target and not args.init_from:
        with torch.no_grad():
            draft.lm_head.weight.copy_(target.model.lm_head[hot].float())
            draft.norm.weight.copy_(target.model.norm.float())
    draft = draft.to(target.model.device)
    meta = {
        "type": "eagle3",
        "init_from": args.init_from,
        "ttt_length": args.ttt_length,
        "ttt_decay": args.ttt_decay,
        "draft_vocab_coverage": round(coverage, 5),
    }
    return _fit(
        args,
        target,
        exs,
        Eagle3Task(target.model, draft, args.ttt_length, args.ttt_decay),
        meta,
        f"draft vocab {cfg.draft_vocab_size} covers {coverage:.4f} of assistant tokens",
        t0,
    )


def _fit(args, target, exs, task, meta_extra: dict, note: str, t0: float) -> int:
    """Batches, Trainer, resume, fit, final export: the same for every draft type."""
    from sglang_ext.training.data import make_batches
    from sglang_ext.training.target import TargetRunner
    from sglang_ext.training.trainer import OptimConfig, RunConfig, Trainer

    batches = make_batches(exs, args.tokens_per_batch, args.seed)
    steps = args.max_steps or max(1, int(args.epochs * len(batches)))
    n_tok = sum(b.num_tokens for b in batches)
    _log(
        f"{len(exs)} conversations, {n_tok} tokens in {len(batches)} batches; {steps} steps; {note}; prep "
        f"{time.time() - t0:.0f}s"
    )
    meta = {
        **meta_extra,
        "target": str(target.path),
        "data": args.data,
        "num_examples": len(exs),
        "max_len": args.max_len,
        "tokens_per_batch": args.tokens_per_batch,
        "total_steps": steps,
        "time_budget_min": args.time_budget_min,
        "lr": args.lr,
        "seed": args.seed,
    }
    runner = TargetRunner(target.model, max(args.tokens_per_batch, max(len(e.input_ids) for e in exs)))
    optim = OptimConfig(
        lr=args.lr, warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip, weight_decay=args.weight_decay
    )
    run = RunConfig(
        args.out,
        steps,
        save_every_s=args.save_every_min * 60,
        time_budget_s=args.time_budget_min * 60 if args.time_budget_min else None,
        seed=args.seed,
        progress_bar=not args.no_progress,
        stop_step=args.stop_at_step,
    )
    trainer = Trainer(task, runner, batches, optim, run, meta)
    if args.resume and trainer.resume():
        _log(f"resumed at step {trainer.step}")
    (Path(args.out) / "train_args.json").write_text(json.dumps(vars(args) | {"train_fn": None}, indent=2, default=str))
    final = trainer.fit()
    task.save(
        Path(args.out) / "final",
        extra_config={
            "training": {
                **meta,
                "step": trainer.step,
                "tokens_seen": trainer.tokens_seen,
                "train_seconds": round(trainer.elapsed_s),
            }
        },
    )
    _log(
        f"done: step {trainer.step}, loss {final.get('loss', float('nan')):.4f}, acc_0 "
        f"{final.get('acc_0', float('nan')):.4f}; exported {Path(args.out) / 'final'}"
    )
    return 0


def train_moa(args) -> int:
    from sglang_ext.models import load_target
    from sglang_ext.models.eagle3 import vocab_from_counts
    from sglang_ext.models.moa import MoAConfig, MoADraft, load_moa
    from sglang_ext.training.moa import MoATask

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target = load_target(args.target, dtype=args.target_dtype, device=_device(args))
    if not 0 <= args.tli < target.cfg.num_layers:
        raise SystemExit(f"--tli must be in [0, {target.cfg.num_layers - 1}]")
    exs = prepare_examples(args, target.tokenizer)
    # the SA mask the drafter runs at inference is the one training ends with
    sa_mode = "self" if args.staircase_max >= 1.0 else "ancestors"
    cfg = MoAConfig.for_target(
        target.cfg,
        tli=args.tli,
        draft_vocab_size=args.draft_vocab_size,
        sa_tree_attention=sa_mode,
        memory_source="last_hidden" if args.no_lsa else "lsa",
    )
    if args.init_from:
        draft = load_moa(args.init_from, target.cfg)
        if (draft.cfg.tli, draft.cfg.memory_source) != (cfg.tli, cfg.memory_source):
            raise SystemExit(
                f"--init-from {args.init_from} has TLI={draft.cfg.tli}, memory {draft.cfg.memory_source}; this run "
                f"asks for TLI={cfg.tli}, {cfg.memory_source}"
            )
        cfg = draft.cfg
    else:
        draft = MoADraft(cfg)
    coverage = 1.0
    if cfg.draft_vocab_size and args.init_from:
        counts = vocab_counts(args, target.tokenizer, exs, target.cfg.vocab_size)
        coverage = float(counts[draft.hot_ids].sum()) / max(1, int(counts.sum()))
    elif cfg.draft_vocab_size:
        counts = vocab_counts(args, target.tokenizer, exs, target.cfg.vocab_size)
        hot = vocab_from_counts(counts, cfg.draft_vocab_size)
        draft.set_vocab(hot)
        coverage = float(counts[hot].sum()) / max(1, int(counts.sum()))
    draft = draft.to(target.model.device)
    task = MoATask(
        target.model,
        draft,
        args.lambda_kl,
        args.lambda_feat,
        args.min_gap,
        args.max_gap,
        args.staircase_ramp,
        args.staircase_max,
        seed=args.seed,
    )
    meta = {
        "type": "moa",
        "init_from": args.init_from,
        "tli": args.tli,
        "memory_source": cfg.memory_source,
        "lambda_kl": args.lambda_kl,
        "lambda_feat": args.lambda_feat,
        "gaps": [args.min_gap, args.max_gap],
        "staircase_ramp": args.staircase_ramp,
        "staircase_max": args.staircase_max,
        "draft_vocab_coverage": round(coverage, 5),
    }
    n_params = sum(p.numel() for p in draft.parameters())
    return _fit(
        args,
        target,
        exs,
        task,
        meta,
        f"MoA TLI={args.tli}, {n_params / 1e6:.1f}M trainable params, draft vocab covers {coverage:.4f}",
        t0,
    )


def train_medusa(args) -> int:
    from sglang_ext.models import load_target
    from sglang_ext.models.eagle3 import vocab_from_counts
    from sglang_ext.models.medusa import MedusaConfig, MedusaHeads, load_medusa
    from sglang_ext.training.data import token_counts
    from sglang_ext.training.medusa import MedusaTask

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target = load_target(args.target, dtype=args.target_dtype, device=_device(args))
    if args.num_heads < 1:
        raise SystemExit("--num-heads must be >= 1")
    exs = prepare_examples(args, target.tokenizer)
    counts = token_counts(exs, target.cfg.vocab_size)
    if args.init_from:
        heads = load_medusa(args.init_from, target.cfg)
    else:
        heads = MedusaHeads(MedusaConfig.for_target(target.cfg, args.num_heads, args.draft_vocab_size))
        heads.set_vocab(vocab_from_counts(counts, heads.cfg.draft_vocab_size))
    coverage = float(counts[heads.hot_ids].sum()) / max(1, int(counts.sum()))
    heads = heads.to(target.model.device)
    meta = {
        "type": "medusa",
        "init_from": args.init_from,
        "num_heads": heads.cfg.num_heads,
        "decay": args.decay,
        "draft_vocab_coverage": round(coverage, 5),
    }
    n_params = sum(p.numel() for p in heads.parameters())
    return _fit(
        args,
        target,
        exs,
        MedusaTask(target.model, heads, args.decay),
        meta,
        f"Medusa, {heads.cfg.num_heads} heads, {n_params / 1e6:.2f}M params, draft vocab covers {coverage:.4f}",
        t0,
    )


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
