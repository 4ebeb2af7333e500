"""Mixture of Attentions (MoA, Zimmer et al. 2024) draft model and its checkpoint format.

Three attention blocks, each a pre-norm decoder layer (attention + SwiGLU MLP, residuals):

    LSA  (layer self-attention, once per verified token)
         in:  the target's cached K|V of that token at every layer, per KV head  [L, W], W = 2*n_kv*head_dim
         one layer attends across the L layers (no mask, RoPE over layer index 0..L-1), mean over L,
         Ekv2E: Linear(W -> H, bias)                                             -> memory m_t  [H]
    SA   (self-attention over the target's token embeddings, causal / tree-masked)
         x1 = SA(embed(x_i)) at position i
    CA   (cross-attention) queries from x1, keys/values from kv_layernorm(m_t) of verified tokens
         x2 = CA(x1; m)                                                          -> the draft feature
    TLI=N  x2 passes through the target's last N layers (their real KV for verified positions), then
           the target's final norm and lm_head (rows of the draft vocab when one is set).

Which target positions a query sees (CA) and which SA keys it sees is the caller's business
(masks in training, KV plans at inference): verified positions only for CA; for SA either the
verified prefix + the query itself ("self", what staircase training converges to) or the prefix
+ the query's tree ancestors ("ancestors"), recorded as `sa_tree_attention` in the config.

Checkpoint: `config.json` (architectures ["MoADraftModel"], tli, sizes) + `model.safetensors`
holding only `layer_self_attention.*`, `Ekv2E.*`, `self_attention.*`, `cross_attention.*` (HEBO's
module groups) and optionally `hot_ids` (draft vocab); embeddings, TLI layers, norm and lm_head
are the target's own and are never stored. `memory_source: "last_hidden"` is the no-LSA ablation:
CA reads the target's last-layer output of each verified token instead (no LSA/Ekv2E weights).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..device import to_device
from ..kernels import Linear
from .checkpoint import (
    CONFIG,
    MOA,
    MOA_ARCH,
    CheckpointError,
    check_fits,
    config_kind,
    load_state,
    read_config,
    read_weights,
    save_weights,
)
from .kv_pool import KVPool
from .llama import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq, rope_of
from .loader import LlamaConfig

SA_MODES = ("self", "ancestors")
MEMORY_SOURCES = ("lsa", "last_hidden")


@dataclass(frozen=True)
class MoAConfig:
    kind: ClassVar[str] = MOA
    hidden_size: int  # target hidden size H
    num_target_layers: int  # L
    target_num_kv_heads: int
    target_head_dim: int
    vocab_size: int  # target vocab
    tli: int = 0  # target layers run on the draft feature
    # SA / CA layers
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    # LSA layer (hidden = 2 * target_num_kv_heads * target_head_dim)
    lsa_num_heads: int = 4
    lsa_num_kv_heads: int = 4
    lsa_intermediate_size: int = 768
    lsa_rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 8192
    draft_vocab_size: int = 0  # 0: the full target vocab
    sa_tree_attention: str = "self"
    memory_source: str = "lsa"  # "last_hidden": ablation without LSA, CA reads the target's last-layer output
    sa_layers: int = 1  # SA decoder layers (more than 1: a training ablation; the drafters serve 1)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def lsa_hidden(self) -> int:
        return 2 * self.target_num_kv_heads * self.target_head_dim

    @classmethod
    def for_target(
        cls,
        t: LlamaConfig,
        tli: int = 0,
        draft_vocab_size: int = 0,
        sa_tree_attention: str = "self",
        memory_source: str = "lsa",
        sa_layers: int = 1,
    ) -> "MoAConfig":
        """SA/CA mirror one target layer's attention shape; LSA heads of the target's head size."""
        w = 2 * t.num_kv_heads * t.head_dim
        lsa_heads = max(1, w // t.head_dim)
        return cls(
            hidden_size=t.hidden_size,
            num_target_layers=t.num_layers,
            target_num_kv_heads=t.num_kv_heads,
            target_head_dim=t.head_dim,
            vocab_size=t.vocab_size,
            tli=tli,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            intermediate_size=t.intermediate_size,
            lsa_num_heads=lsa_heads,
            lsa_num_kv_heads=lsa_heads,
            lsa_intermediate_size=w * 3 // 2,
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=t.rope_theta,
            rope_scaling=t.rope_scaling,
            max_position=t.max_position,
            draft_vocab_size=draft_vocab_size if 0 < draft_vocab_size < t.vocab_size else 0,
            sa_tree_attention=sa_tree_attention,
            memory_source=memory_source,
            sa_layers=sa_layers,
        ).validated()

    def validated(self) -> "MoAConfig":
        if not 0 <= self.tli <= self.num_target_layers:
            raise CheckpointError(f"tli={self.tli} outside [0, {self.num_target_layers}]")
        if self.sa_tree_attention not in SA_MODES:
            raise CheckpointError(f"sa_tree_attention must be one of {SA_MODES}, got {self.sa_tree_attention!r}")
        if self.sa_layers < 1:
            raise CheckpointError(f"sa_layers must be >= 1, got {self.sa_layers}")
        if self.memory_source not in MEMORY_SOURCES:
            raise CheckpointError(f"memory_source must be one of {MEMORY_SOURCES}, got {self.memory_source!r}")
        if (
            self.lsa_hidden % self.lsa_num_heads
            or self.num_heads % self.num_kv_heads
            or self.lsa_num_heads % self.lsa_num_kv_heads
        ):
            raise CheckpointError("head counts do not divide the hidden sizes")
        return self

    def to_json(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, "architectures": [MOA_ARCH], "model_type": "moa_draft", **d}

    @classmethod
    def from_json(cls, d: dict) -> "MoAConfig":
        if config_kind(d) != MOA:
            raise CheckpointError(f"not a MoA checkpoint: architectures={d.get('architectures')}")
        names = {f.name for f in fields(cls)} - {"extra"}
        missing = [
            k
            for k in ("hidden_size", "num_target_layers", "target_num_kv_heads", "target_head_dim", "vocab_size")
            if k not in d
        ]
        if missing:
            raise CheckpointError(f"MoA config lacks {missing}")
        extra = {k: v for k, v in d.items() if k not in names and k not in ("architectures", "model_type")}
        try:
            return cls(**{k: v for k, v in d.items() if k in names}, extra=extra).validated()
        except (TypeError, ZeroDivisionError) as e:  # a field of the wrong type, or a zero head count
            raise CheckpointError(f"bad MoA config: {e}") from e


class _Attention(nn.Module):
    def __init__(self, q_in: int, kv_in: int, out: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj = Linear(q_in, heads * head_dim, bias=False)
        self.k_proj = Linear(kv_in, kv_heads * head_dim, bias=False)
        self.v_proj = Linear(kv_in, kv_heads * head_dim, bias=False)
        self.o_proj = Linear(heads * head_dim, out, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """Pre-norm decoder layer; `cross=True` adds a norm for the key/value stream."""

    def __init__(
        self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, eps: float, cross: bool = False
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        attn = _Attention(hidden, hidden, hidden, heads, kv_heads, head_dim)
        if cross:
            self.kv_layernorm = RMSNorm(hidden, eps)
            self.cross_attn = attn
        else:
            self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = _MLP(hidden, inter)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    @property
    def attn(self) -> _Attention:
        return self.cross_attn if hasattr(self, "cross_attn") else self.self_attn

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.q_proj(self.input_layernorm(x)).unflatten(-1, (self.heads, self.head_dim))

    def qkv(self, x: torch.Tensor):
        """Self-attention projections of x (one norm) -> q [.., heads, D], k/v [.., kv_heads, D]."""
        h = self.input_layernorm(x)
        return (self.attn.q_proj(h).unflatten(-1, (self.heads, self.head_dim)), *self.kv(h))

    def kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h already normed -> k, v [.., kv_heads, head_dim]."""
        a = self.attn
        return a.k_proj(h).unflatten(-1, (self.kv_heads, self.head_dim)), a.v_proj(h).unflatten(
            -1, (self.kv_heads, self.head_dim)
        )

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + self.attn.o_proj(attn_out.flatten(-2))
        return h + self.mlp(self.post_attention_layernorm(h))


class MoAPieces:
    """The per-token pieces around attention, shared by MoADraft (plain torch layers) and the SGLang
    plugin's model (SGLang's fused layers). A host supplies blocks `layer_self_attention`,
    `self_attention`, `cross_attention` with q(x) / qkv(x) / kv(normed) / finish(attn, residual)
    (+ kv_layernorm on the cross block), `Ekv2E`, `inv_freq` and `lsa_inv_freq`."""

    def _ekv2e(self, x: torch.Tensor) -> torch.Tensor:
        return self.Ekv2E(x)

    # --- LSA: once per verified token -----------------------------------------------------------
    def lsa(self, layer_kv: torch.Tensor) -> torch.Tensor:
        """[N, L, W] stacked target K|V -> memory [N, H]."""
        lay = self.layer_self_attention
        x = layer_kv.to(self.Ekv2E.weight.dtype)
        q, k, v = lay.qkv(x)
        cos, sin = self._lsa_rope(x.shape[-2], q.dtype, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=lay.heads != lay.kv_heads
        )
        x = lay.finish(a.transpose(1, 2), x)
        return self._ekv2e(x.mean(dim=1))

    def _lsa_rope(self, num_layers: int, dtype: torch.dtype, device: torch.device):
        """cos/sin of the layer positions 0..L-1: the same for every token, so made once."""
        key = (num_layers, dtype, device)
        cache = self.__dict__.setdefault("_lsa_rope_cache", {})
        if key not in cache:
            cache[key] = rope_of(self.lsa_inv_freq, torch.arange(num_layers, device=device), dtype)
        return cache[key]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin of token positions, for sa_qkv / ca_q (a draft pass makes them once for both)."""
        tables = self.__dict__.setdefault("_rope_tables", {})
        return rope_cos_sin(self.inv_freq, positions, dtype, tables, self.cfg.max_position)

    # --- SA -------------------------------------------------------------------------------------
    def sa_qkv(self, embeds: torch.Tensor, positions: torch.Tensor, rope=None):
        q, k, v = self.self_attention.qkv(embeds)
        cos, sin = rope or self.rope(to_device(positions, q.device), q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def sa_finish(self, attn_out: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.self_attention.finish(attn_out, embeds)

    # --- CA -------------------------------------------------------------------------------------
    def ca_kv(self, memory: torch.Tensor, positions: torch.Tensor):
        """LSA memory of verified tokens -> CA keys/values (cached by the caller)."""
        lay = self.cross_attention
        k, v = lay.kv(lay.kv_layernorm(memory))
        cos, sin = self.rope(to_device(positions, k.device), k.dtype)
        return apply_rope(k, cos, sin), v

    def ca_q(self, x1: torch.Tensor, positions: torch.Tensor, rope=None) -> torch.Tensor:
        q = self.cross_attention.q(x1)
        cos, sin = rope or self.rope(to_device(positions, q.device), q.dtype)
        return apply_rope(q, cos, sin)

    def ca_finish(self, attn_out: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        return self.cross_attention.finish(attn_out, x1)


class MoADraft(MoAPieces, nn.Module):
    """Weights + the per-token pieces around attention (attention itself is supplied by the caller)."""

    def __init__(self, cfg: MoAConfig):
        super().__init__()
        self.cfg = cfg
        w, h = cfg.lsa_hidden, cfg.hidden_size
        if cfg.memory_source == "lsa":
            self.layer_self_attention = _Layer(
                w,
                cfg.lsa_intermediate_size,
                cfg.lsa_num_heads,
                cfg.lsa_num_kv_heads,
                w // cfg.lsa_num_heads,
                cfg.rms_norm_eps,
            )
            self.Ekv2E = Linear(w, h, bias=True)
        self.self_attention = _Layer(
            h, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        )
        self.cross_attention = _Layer(
            h, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cross=True
        )
        # the training ablation's further SA layers (run after self_attention), made last: the other blocks
        # start as those of a one-layer head of the same seed
        if cfg.sa_layers > 1:
            self.more_self_attention = nn.ModuleList(
                _Layer(h, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
                for _ in range(cfg.sa_layers - 1)
            )
        vd = cfg.draft_vocab_size or cfg.vocab_size
        self.register_buffer("hot_ids", torch.arange(vd, dtype=torch.long))
        # NOTE: plain attributes, not buffers, so module.to(bfloat16) keeps RoPE frequencies in fp32
        self.inv_freq = rope_inv_freq(cfg)  # type: ignore[arg-type]  (token positions, the target's RoPE)
        self.lsa_inv_freq = 1.0 / (
            cfg.lsa_rope_theta
            ** (torch.arange(0, w // cfg.lsa_num_heads, 2, dtype=torch.float32) / (w // cfg.lsa_num_heads))
        )
        self.scale = cfg.head_dim**-0.5

    def set_vocab(self, hot_ids: torch.Tensor) -> None:
        hot_ids = hot_ids.to(torch.long).sort().values
        if hot_ids.numel() != self.hot_ids.numel():
            raise ValueError(f"expected {self.hot_ids.numel()} draft ids, got {hot_ids.numel()}")
        self.hot_ids.copy_(hot_ids)

    # --- checkpoint -----------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        if not self.cfg.draft_vocab_size:
            state.pop("hot_ids")
        cfg = self.cfg.to_json() | {"torch_dtype": str(dtype).removeprefix("torch.")} | (extra_config or {})
        save_weights(state, out)
        (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def stack_layer_kv(k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The LSA input of the tokens at `slots` (any shape S): [*S, L, 2*n_kv*D], K|V per KV head.

    k_layers/v_layers: the target's per-layer pools [num_slots, n_kv, D] (keys as cached, after RoPE).
    Host-built slots go up once (queued), not once per layer (an index on the host waits on a GPU)."""
    slots = to_device(slots, k_layers[0].device)
    both = _one_tensor([*k_layers, *v_layers])
    if both is not None:  # the layers are evenly spaced in one storage (a host pool): one index op
        s = slots.dim()
        x = both[:, slots].unflatten(0, (2, len(k_layers)))  # [2, L, *S, n_kv, D]
        return x.permute(*range(2, 2 + s), 1, 2 + s, 0, 3 + s).flatten(-3)
    k = torch.stack([kl[slots] for kl in k_layers], dim=-3)  # [*S, L, n_kv, D]
    v = torch.stack([vl[slots] for vl in v_layers], dim=-3)
    return torch.cat([k, v], dim=-1).flatten(-2)


def _one_tensor(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """ts as one tensor [len(ts), *shape] without a copy when they are contiguous tensors of one shape lying one
    after another in one storage (kv_pool.zeroed_buffers' host pools), else None (also for tensors autograd tracks:
    a view of the first would not carry the others' history)."""
    t0 = ts[0]
    step, ptr = t0.numel(), t0.untyped_storage().data_ptr()
    for i, t in enumerate(ts):
        if not t.is_contiguous() or t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
            return None
        if t.requires_grad:
            return None
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != t0.storage_offset() + i * step:
            return None
    return t0.as_strided((len(ts), *t0.shape), (step, *t0.stride()), t0.storage_offset())


def stack_pool_kv(kv: KVPool, slots: torch.Tensor) -> torch.Tensor:
    return stack_layer_kv(kv.k, kv.v, slots)


# --- reading checkpoints ----------------------------------------------------------------------
GROUPS = ("layer_self_attention.", "Ekv2E.", "self_attention.", "cross_attention.", "more_self_attention.")
WRAPPER_PREFIXES = ("module.", "model.", "draft_model.", "draft.")


def strip_wrappers(name: str) -> str:
    """A checkpoint tensor name without the prefixes training wrappers add (`model.`, `draft_model.`)."""
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix) and not name.startswith(GROUPS):
            name = name[len(prefix) :]
    return name


def _canonical_name(name: str) -> str | None:
    """Our name of a checkpoint tensor; None for weights we do not keep."""
    name = strip_wrappers(name)
    if name == "hot_ids" or name.startswith(GROUPS):
        return name
    return None


def load_moa(
    ckpt_dir: str | Path, target_cfg: LlamaConfig | None = None, dtype: torch.dtype = torch.float32
) -> MoADraft:
    ckpt = Path(ckpt_dir).expanduser()
    cfg = MoAConfig.from_json(read_config(ckpt))
    if target_cfg is not None:
        check_fits(cfg, target_cfg)
    state: dict[str, torch.Tensor] = {}
    for k, v in read_weights(ckpt).items():
        name = _canonical_name(k)
        if name is not None:
            state[name] = v
    model = MoADraft(cfg)
    if "hot_ids" not in state:
        state["hot_ids"] = model.hot_ids.clone()
    state["hot_ids"] = state["hot_ids"].long()
    load_state(model, state, ckpt)
    return model.to(dtype)


__all__ = ["MoAConfig", "MoADraft", "load_moa", "stack_layer_kv", "stack_pool_kv", "strip_wrappers"]
