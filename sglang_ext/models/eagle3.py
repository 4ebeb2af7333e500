"""EAGLE-3 draft model and its checkpoint format (SpecForge 0.2.0 / SGLang 0.5.23).

One decoder layer over fused target features. For the pair at feature position t
(embedding of token t+1, feature of token t), with `feat` either fc(low|mid|high target features)
(first draft step) or the draft's own pre-norm output of the parent pair (later steps):

    residual = feat
    x   = cat(input_layernorm(embed), hidden_norm(feat))          [.., 2H]
    h   = o_proj(attn(q_proj(x), k_proj(x), v_proj(x))) + residual
    out = h + mlp(post_attention_layernorm(h))                    fed back as the next step's feature
    logits = lm_head(norm(out))                                    over the draft vocab

Draft id i is target id i + d2t[i]; t2d[target id] says whether it is in the draft vocab.
Attention is supplied by the caller (TTT attention in training, the KV pool at inference), so
the module holds only weights and the per-token pieces around attention.

Checkpoint: `config.json` (architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
eagle_config.eagle_aux_hidden_state_layer_ids = target layers whose *outputs* are fused) and
`model.safetensors` with fc, midlayer.*, norm, lm_head, d2t, t2d; no embeddings (shared with the
target). Reading also accepts SpecForge/SGLang variants: `layers.0.*` for `midlayer.*`, a `model.`
prefix, embed weights (ignored), pytorch_model.bin, missing d2t/t2d (identity vocab).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..device import to_device
from ..kernels import Linear
from .checkpoint import (
    CONFIG,
    EAGLE3,
    EAGLE3_ARCH,
    CheckpointError,
    check_fits,
    config_kind,
    load_state,
    read_config,
    read_weights,
    save_weights,
)
from .llama import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from .loader import LlamaConfig


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Outputs of layers 1, L/2-1, L-4: what SGLang captures when the config names none (each kept inside
    [0, L-1], for targets of fewer than 4 layers)."""
    return tuple(min(max(layer, 0), num_layers - 1) for layer in (1, num_layers // 2 - 1, num_layers - 4))


@dataclass(frozen=True)
class Eagle3Config:
    kind: ClassVar[str] = EAGLE3
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # target vocab
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # target layers whose outputs are fused by fc
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 8192
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict, compare=False)  # unknown config.json keys, kept on save

    @classmethod
    def for_target(
        cls, target: LlamaConfig, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None
    ) -> "Eagle3Config":
        """The draft layer mirrors one target layer (SpecForge's default)."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            aux_layers=tuple(aux_layers or default_aux_layers(target.num_layers)),
            target_hidden_size=target.hidden_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position=target.max_position,
        )

    def to_hf(self) -> dict:
        cfg = dict(self.extra)
        cfg.update(
            architectures=[EAGLE3_ARCH],
            model_type="llama",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position,
            hidden_act=self.hidden_act,
            tie_word_embeddings=False,
            attention_bias=False,
            torch_dtype="bfloat16",
            eagle_config={**cfg.get("eagle_config", {}), "eagle_aux_hidden_state_layer_ids": list(self.aux_layers)},
        )
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict, target_layers: int | None = None) -> "Eagle3Config":
        arch = cfg.get("architectures") or []
        if arch and config_kind(cfg) != EAGLE3:
            raise CheckpointError(f"not an EAGLE-3 checkpoint: architectures={arch}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise CheckpointError(
                f"only 1-layer EAGLE-3 drafts are supported, got num_hidden_layers={cfg['num_hidden_layers']}"
            )
        eagle = cfg.get("eagle_config") or {}
        unsupported = [
            k
            for k in ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output", "bias")
            if eagle.get(k) or cfg.get(k)
        ]
        if unsupported:
            raise CheckpointError(f"unsupported EAGLE-3 options in config: {unsupported}")
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if target_layers is None:
                raise CheckpointError("config has no eagle_aux_hidden_state_layer_ids and the target depth is unknown")
            aux = default_aux_layers(target_layers)
        try:
            lc = LlamaConfig.from_hf({**cfg, "num_hidden_layers": 1})
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"bad EAGLE-3 config: {type(e).__name__} {e}") from e
        known = {"eagle_config", "draft_vocab_size", "target_hidden_size"}
        return cls(
            hidden_size=lc.hidden_size,
            intermediate_size=lc.intermediate_size,
            num_heads=lc.num_heads,
            num_kv_heads=lc.num_kv_heads,
            head_dim=lc.head_dim,
            vocab_size=lc.vocab_size,
            draft_vocab_size=cfg.get("draft_vocab_size") or lc.vocab_size,
            aux_layers=tuple(aux),
            target_hidden_size=cfg.get("target_hidden_size") or lc.hidden_size,
            rms_norm_eps=lc.rms_norm_eps,
            rope_theta=lc.rope_theta,
            rope_scaling=lc.rope_scaling,
            max_position=lc.max_position,
            hidden_act=cfg.get("hidden_act", "silu"),
            extra={k: v for k, v in cfg.items() if k in known - {"draft_vocab_size", "target_hidden_size"}},
        )


class _Attn(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        d_in = 2 * c.hidden_size
        self.q_proj = Linear(d_in, c.num_heads * c.head_dim, bias=False)
        self.k_proj = Linear(d_in, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = Linear(d_in, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = _Attn(c)
        self.mlp = _MLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Draft(nn.Module):
    """Weights + the per-token computations around attention. Shapes: any leading dims [..]."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(len(cfg.aux_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.t2d[: cfg.draft_vocab_size] = True
        # NOTE: a plain attribute, not a buffer, so module.to(bfloat16) keeps RoPE frequencies in fp32
        self.inv_freq = rope_inv_freq(cfg)  # type: ignore[arg-type]

    # --- vocab --------------------------------------------------------------------------------
    @property
    def hot_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def set_vocab(self, hot_ids: torch.Tensor) -> None:
        """hot_ids: [Vd] sorted target ids making up the draft vocab."""
        hot_ids = hot_ids.to(torch.long).sort().values
        if hot_ids.numel() != self.cfg.draft_vocab_size:
            raise ValueError(f"expected {self.cfg.draft_vocab_size} draft ids, got {hot_ids.numel()}")
        self.d2t.copy_(hot_ids - torch.arange(hot_ids.numel(), device=hot_ids.device))
        self.t2d.zero_()
        self.t2d[hot_ids] = True

    # --- forward pieces -----------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[.., n_aux*Ht] concatenated target features -> [.., H]."""
        return self.fc(aux)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [.., 1, D] of positions [..] (rope_cos_sin)."""
        tables = self.__dict__.setdefault("_rope_tables", {})
        return rope_cos_sin(self.inv_freq, positions, dtype, tables, self.cfg.max_position)

    def qkv(self, embeds: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor):
        """-> q [.., Hq, D], k/v [.., Hkv, D] (RoPE applied)."""
        c, lay = self.cfg, self.midlayer
        x = torch.cat([lay.input_layernorm(embeds), lay.hidden_norm(feat)], dim=-1)
        a = lay.self_attn
        q = a.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim))
        k = a.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = a.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        # (positions may be host-built: a drafter's step on a GPU target; cos/sin go where q is)
        cos, sin = self.rope(to_device(positions, q.device), q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn_out: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """attn_out [.., Hq, D], feat = the residual -> pre-norm output [.., H]."""
        lay = self.midlayer
        h = lay.self_attn.o_proj(attn_out.flatten(-2)) + feat
        return h + lay.mlp(lay.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [.., H] -> draft-vocab logits [.., Vd]."""
        return self.lm_head(self.norm(out))

    # --- checkpoint ---------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        cfg = self.cfg.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")} | (extra_config or {})
        save_weights(state, out)
        (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


# --- reading checkpoints ----------------------------------------------------------------------
_NAME_FIXES = (("layers.0.", "midlayer."),)


def _canonical_name(name: str) -> str | None:
    """Map SpecForge/SGLang name variants to ours; None for weights we ignore (embeddings)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if "embed_tokens" in name:
        return None
    for old, new in _NAME_FIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
    return name


def load_eagle3(
    ckpt_dir: str | Path, target_cfg: LlamaConfig | None = None, dtype: torch.dtype = torch.float32
) -> Eagle3Draft:
    """Read an EAGLE-3 checkpoint (ours or SpecForge's); check it against the target if given."""
    ckpt = Path(ckpt_dir).expanduser()
    cfg = Eagle3Config.from_hf(read_config(ckpt), target_cfg.num_layers if target_cfg else None)
    if target_cfg is not None:
        check_fits(cfg, target_cfg)
    model = Eagle3Draft(cfg)
    state = {}
    for k, v in read_weights(ckpt).items():
        name = _canonical_name(k)
        if name is not None:
            state[name] = v
    if "d2t" not in state:  # no reduced vocab: identity mapping
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state and state["d2t"].numel() == cfg.draft_vocab_size:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[state["d2t"].long() + torch.arange(cfg.draft_vocab_size)] = True
        state["t2d"] = t2d
    state["d2t"] = state["d2t"].long()
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    load_state(model, state, ckpt)
    return model.to(dtype)


def vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Sorted target ids of the draft vocab: the most frequent tokens (ties -> lower id)."""
    order = torch.argsort(-counts.double(), stable=True)
    return order[:draft_vocab_size].sort().values


__all__ = [
    "Eagle3Config",
    "Eagle3Draft",
    "default_aux_layers",
    "load_eagle3",
    "vocab_from_counts",
]
