"""The one configuration of a training run (job.run): heads, target, data, schedule, device, output.

Every `moa-serve train` command fills it from its flags (moa_serve/entrypoints/train.py): `train eagle3`,
`train moa --tli N` and `train medusa` train one head, `train job` several on the same batches; they
differ only in defaults.

Heads are named `eagle3`, `medusa` and `moa-tli<N>` (MoA running N target layers on its feature). A head
name may carry a variant, `<head>@key=value[@key=value...]`: that head's own options (a field of its
kind's options below, or `lr`) over the run's, so one job trains recipe variants on the same batches and
the same target run (`train job --heads moa-tli1,moa-tli1@lambda_feat=0.3,moa-tli1@lr=3e-4`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

HEADS = ("eagle3", "moa-tli0", "moa-tli1")  # the job's heads: one target run trains all three


class TrainError(ValueError):
    """A run's inputs cannot train (an unknown head, data for another vocabulary, a run directory in the way)."""


@dataclass(frozen=True)
class Eagle3Options:
    ttt_length: int = 7  # draft steps unrolled in training (training-time test)
    decay: float = 0.8  # step j's loss weight is decay**j
    aux_layers: tuple[int, ...] | None = None  # target layers whose outputs are fused (default 1, L/2-1, L-4)
    init_head_from_target: bool = True  # lm_head rows and final norm start from the target's


@dataclass(frozen=True)
class MoAOptions:
    # NOTE: HEBO uses 0.1 / 1.0 for Llama-3-8B; SmolLM2's residual stream is large enough that its
    # SmoothL1 term (~17 at init vs KL ~15) would swamp the KL, so our defaults weight the KL.
    lambda_kl: float = 1.0
    lambda_feat: float = 0.1
    min_gap: int = 6  # verification points every K in [min_gap, max_gap] tokens
    max_gap: int = 14
    staircase_ramp: float = 0.5  # fraction of training over which the SA staircase probability ramps up
    staircase_max: float = 1.0  # its final value (1: the drafter's SA sees only the verified prefix + itself)
    no_lsa: bool = False  # ablation: CA reads the target's last-layer output instead of LSA over all layers' K/V
    position_decay: float = 1.0  # a row at draft depth d (gap d + 1 to its verification point) weighs decay**d
    sa_layers: int = 1  # self-attention layers over the token embeddings (the drafter serves 1)


@dataclass(frozen=True)
class MedusaOptions:
    num_heads: int = 4  # head k drafts tree depth k + 1
    decay: float = 0.8  # head k's loss weight is decay**k


@dataclass(frozen=True)
class TrainConfig:
    out: str  # run directory: checkpoints, metrics, heads/, curves.json, summary.json
    # heads
    heads: tuple[str, ...] = ("eagle3",)
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)
    moa: MoAOptions = field(default_factory=MoAOptions)
    medusa: MedusaOptions = field(default_factory=MedusaOptions)
    init_from: str | None = None  # fine-tune: start from <dir>/<head> (or <dir> itself for one head; "shipped")
    # target
    target: str = "smollm2"  # 'smollm2' or a local HF Llama / Qwen2 / Mistral directory
    target_gguf: str | None = None  # a GGUF file of the target (converted once into `cache`)
    cache: str = "/tmp/moa-serve-job-cache"
    target_dtype: str = "auto"
    # data
    data: tuple[str, ...] = ()  # 'sharegpt', .json / .jsonl conversations, token shard directories
    num_examples: int | None = None  # training examples at most (a seeded sample); None: every one (2000 per file
    # of conversations, which are tokenised)
    max_examples: int | None = None  # the first this many examples (windows) of each source
    max_len: int = 1024
    tokens_per_batch: int = 4096  # padded tokens per global batch (split over the ranks)
    draft_vocab_size: int = 16384
    vocab_examples: int = 0  # conversations whose assistant tokens pick the draft vocab (0: the training set)
    distill_repeat: int = 1  # the target's own answers (sources `distill:*`) repeated this often per epoch
    holdout: float = 0.0  # fraction of each source held out and scored at the end
    # schedule
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    stop_at_step: int | None = None  # end here, keeping the full run's LR schedule
    time_budget_min: float | None = None  # training time; the LR schedule follows it
    deadline_min: float | None = None  # wall time of the whole run: training stops in time to export and score
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    # device
    device: str = "auto"  # auto | cpu | cuda (under torchrun: cuda:<local rank>)
    threads: int | None = None  # torch CPU threads (None: torch's default)
    autocast: bool | None = None  # bf16 autocast around the heads (None: on accelerators and AMX CPUs)
    # output
    save_every_min: float = 5.0
    save_every_steps: int | None = None
    keep_checkpoints: int = 3
    log_every: int = 1
    progress: bool = True
    resume: str | None = None  # continue from this run or checkpoint directory ('' or out: this run's own)
    pack: str | None = None  # also bundle heads + curves + summary as heads.tar.partNN (<= 15 MiB) here
    smoke: bool = False  # small random target, tiny batches, a few steps (the CPU test of the same code path)

    def checked(self) -> "TrainConfig":
        """self, or a TrainError naming the first field that cannot run."""
        for h in self.heads:
            head_options(h, self)
        if not self.heads:
            raise TrainError("no heads to train")
        if len(set(self.heads)) != len(self.heads):
            raise TrainError(f"a head is named twice in {self.heads}")
        if not self.data and not self.smoke:
            raise TrainError("no training data (--data)")
        positive = ("max_len", "tokens_per_batch", "keep_checkpoints", "log_every")
        for name in positive + ("num_examples", "max_examples", "max_steps", "save_every_steps", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TrainError(f"{name} must be >= 1, got {value}")
        if not 0.0 <= self.holdout < 1.0:
            raise TrainError(f"holdout must be in [0, 1), got {self.holdout}")
        if self.medusa.num_heads < 1:
            raise TrainError(f"medusa num_heads must be >= 1, got {self.medusa.num_heads}")
        return self


def head_kind(name: str) -> tuple[str, int]:
    """('eagle3' | 'medusa' | 'moa', TLI) of a head name (its variant aside), or a TrainError."""
    base = name.split("@", 1)[0]
    if base in ("eagle3", "medusa"):
        return base, 0
    tli = base.removeprefix("moa-tli")
    if base.startswith("moa-tli") and tli.isdigit():
        return "moa", int(tli)
    raise TrainError(f"unknown head {base!r}; choose from eagle3, medusa, moa-tli<N> (e.g. {', '.join(HEADS)})")


HeadOptions = Eagle3Options | MoAOptions | MedusaOptions


def head_options(name: str, cfg: TrainConfig) -> tuple[HeadOptions, float | None]:
    """(options, learning rate) of one head: the run's options with the head's variant `@key=value...` over
    them, and the variant's learning rate (None: the run's)."""
    kind, _ = head_kind(name)
    opts: HeadOptions = {"eagle3": cfg.eagle3, "moa": cfg.moa, "medusa": cfg.medusa}[kind]
    lr = None
    known = {f.name: f for f in fields(opts)}
    changes = {}
    for item in name.split("@")[1:]:
        key, eq, text = item.partition("=")
        if not eq or not text:
            raise TrainError(f"head {name!r}: a variant is @key=value, got {item!r}")
        if key == "lr":
            lr = _parse(name, key, text, 0.0)
            if lr <= 0:
                raise TrainError(f"head {name!r}: lr must be > 0")
        elif key in known and key != "aux_layers":
            changes[key] = _parse(name, key, text, getattr(opts, key))
        else:
            allowed = sorted(k for k in known if k != "aux_layers") + ["lr"]
            raise TrainError(f"head {name!r}: {kind} has no option {key!r} (options: {', '.join(allowed)})")
    opts = replace(opts, **changes)
    if isinstance(opts, MoAOptions):
        if not 1 <= opts.min_gap <= opts.max_gap:
            raise TrainError(f"head {name!r}: need 1 <= min_gap <= max_gap, got {opts.min_gap}, {opts.max_gap}")
        if opts.sa_layers < 1 or not 0.0 < opts.position_decay <= 1.0:
            raise TrainError(f"head {name!r}: need sa_layers >= 1 and 0 < position_decay <= 1")
    return opts, lr


def _parse(name: str, key: str, text: str, like):
    """text as the type of `like` (bool, int or float)."""
    try:
        if isinstance(like, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return type(like)(text) if isinstance(like, (int, float)) else float(text)
    except ValueError:
        raise TrainError(f"head {name!r}: {key}={text!r} is not a {type(like).__name__}") from None


def config_fields() -> set[str]:
    return {f.name for f in fields(TrainConfig)}
