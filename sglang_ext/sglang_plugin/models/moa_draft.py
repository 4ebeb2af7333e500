"""The MoA draft model for SGLang's model loader (`EntryClass`), built from SGLang layers.

Same weights and same per-token pieces as `sglang_ext.models.moa.MoADraft` (the embedded engine's
model), with SGLang's fused projections:

    checkpoint name                                   parameter here (shard)
    <block>.self_attn.{q,k,v}_proj.weight             <block>.self_attn.qkv_proj.weight  (q / k / v)
    <block>.mlp.{gate,up}_proj.weight                 <block>.mlp.gate_up_proj.weight    (0 / 1)
    cross_attention.cross_attn.{k,v}_proj.weight      cross_attention.cross_attn.kv_proj.weight (0 / 1)
    everything else                                   same name
    hot_ids                                           buffer `hot_ids` (draft vocab -> target ids)

<block> is `layer_self_attention` (LSA) or `self_attention` (SA). Embeddings, the TLI layers,
the final norm and lm_head are the target's and are never part of this module.

Attention itself is not here: the MoA worker (sglang_plugin/worker.py) calls `lsa`, `sa_qkv`,
`sa_finish`, `ca_kv`, `ca_q`, `ca_finish` around its tree-attention backend, exactly as the
embedded drafter does; those come from `MoAPieces`, the embedded model's own code, over blocks that
expose the same q / qkv / kv / finish methods. `forward` therefore refuses to run: the model is never driven by
ModelRunner.forward.

RoPE uses the embedded model's functions (plain torch; RoPE has no weights). Tensor parallelism:
the layers are SGLang's TP layers, but the plugin accepts tp_size = 1 only (LSA reads every KV
head of every target layer, which TP splits across ranks).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from sglang.srt.configs.draft_parallel import DraftParallelSpec, DraftTPExecution
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.srt.model_loader.weight_utils import default_weight_loader
from torch import nn

from ...models.checkpoint import MOA_ARCH, CheckpointError
from ...models.llama import rope_inv_freq
from ...models.moa import MoAConfig, MoAPieces, strip_wrappers
from ..hf_config import MoADraftHFConfig

# (parameter fragment, checkpoint fragment, shard id)
STACKED = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
CROSS_STACKED = (
    (".kv_proj.", ".k_proj.", 0),
    (".kv_proj.", ".v_proj.", 1),
)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=False, prefix=_join(prefix, "gate_up_proj")
        )
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, prefix=_join(prefix, "down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)[0]


class _SelfProj(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, prefix: str):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, heads, kv_heads, bias=False, prefix=_join(prefix, "qkv_proj")
        )
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=False, prefix=_join(prefix, "o_proj"))


class _CrossProj(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, prefix: str):
        super().__init__()
        self.q_proj = ColumnParallelLinear(hidden, heads * head_dim, bias=False, prefix=_join(prefix, "q_proj"))
        self.kv_proj = MergedColumnParallelLinear(
            hidden, [kv_heads * head_dim] * 2, bias=False, prefix=_join(prefix, "kv_proj")
        )
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=False, prefix=_join(prefix, "o_proj"))


class _Block(nn.Module):
    """Pre-norm decoder layer around an externally computed attention; `cross` adds kv_layernorm."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        prefix: str,
        cross: bool = False,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        if cross:
            self.kv_layernorm = RMSNorm(hidden, eps=eps)
            self.cross_attn = _CrossProj(hidden, heads, kv_heads, head_dim, _join(prefix, "cross_attn"))
        else:
            self.self_attn = _SelfProj(hidden, heads, kv_heads, head_dim, _join(prefix, "self_attn"))
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.mlp = _MLP(hidden, inter, _join(prefix, "mlp"))

    @property
    def proj(self) -> nn.Module:
        return self.cross_attn if hasattr(self, "cross_attn") else self.self_attn

    def qkv(self, x: torch.Tensor):
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))[0]
        nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([nq, nk, nk], dim=-1)
        return (
            q.unflatten(-1, (self.heads, self.head_dim)),
            k.unflatten(-1, (self.kv_heads, self.head_dim)),
            v.unflatten(-1, (self.kv_heads, self.head_dim)),
        )

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return self.cross_attn.q_proj(self.input_layernorm(x))[0].unflatten(-1, (self.heads, self.head_dim))

    def kv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h already normed -> k, v [.., kv_heads, head_dim] (cross block)."""
        k, v = self.cross_attn.kv_proj(h)[0].chunk(2, dim=-1)
        return k.unflatten(-1, (self.kv_heads, self.head_dim)), v.unflatten(-1, (self.kv_heads, self.head_dim))

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + self.proj.o_proj(attn_out.flatten(-2))[0]
        return h + self.mlp(self.post_attention_layernorm(h))


class MoADraftModel(MoAPieces, nn.Module):
    # One TP group, token rows as given (what EAGLE-3's draft declares too).
    draft_parallel_spec = DraftParallelSpec(tp_execution=DraftTPExecution.SINGLE_GROUP)

    def __init__(self, config: MoADraftHFConfig, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError(
                "the MoA draft model does not support quantization (--speculative-draft-model-quantization)"
            )
        cfg: MoAConfig = config.moa_config() if hasattr(config, "moa_config") else MoAConfig.from_json(config.to_dict())
        if cfg.memory_source != "lsa":
            raise ValueError(
                f"the SGLang MoA plugin runs memory_source='lsa' checkpoints only, got {cfg.memory_source!r}"
            )
        self.config, self.cfg = config, cfg
        w, h = cfg.lsa_hidden, cfg.hidden_size
        self.layer_self_attention = _Block(
            w,
            cfg.lsa_intermediate_size,
            cfg.lsa_num_heads,
            cfg.lsa_num_kv_heads,
            w // cfg.lsa_num_heads,
            cfg.rms_norm_eps,
            _join(prefix, "layer_self_attention"),
        )
        self.Ekv2E = ReplicatedLinear(w, h, bias=True, prefix=_join(prefix, "Ekv2E"))
        self.self_attention = _Block(
            h,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            _join(prefix, "self_attention"),
        )
        self.cross_attention = _Block(
            h,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            _join(prefix, "cross_attention"),
            cross=True,
        )
        self.register_buffer(
            "hot_ids", torch.arange(cfg.draft_vocab_size or cfg.vocab_size, dtype=torch.long), persistent=False
        )
        # NOTE: plain attributes (not buffers) keep RoPE frequencies fp32 whatever the model dtype
        self.inv_freq = rope_inv_freq(cfg)  # type: ignore[arg-type]
        lsa_d = w // cfg.lsa_num_heads
        self.lsa_inv_freq = 1.0 / (cfg.lsa_rope_theta ** (torch.arange(0, lsa_d, 2, dtype=torch.float32) / lsa_d))
        self.scale = cfg.head_dim**-0.5
        self.loaded_weight_names: set[str] = set()  # checkpoint names consumed by load_weights

    # --- per-token pieces: MoAPieces (the embedded model's code) over these blocks -----------------
    def _ekv2e(self, x: torch.Tensor) -> torch.Tensor:
        return self.Ekv2E(x)[0]  # SGLang linears return (output, bias)

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "MoADraftModel is driven by the MoA worker (sglang_ext.sglang_plugin.worker), not by ModelRunner.forward"
        )

    # --- weights ----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors; CheckpointError for a name that maps to no parameter or a tensor of
        the wrong shape. Returns the parameter names loaded (fused ones once per shard)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = strip_wrappers(ckpt_name)  # the prefixes the embedded loader strips
            if name == "hot_ids":
                if tensor.numel() != self.hot_ids.numel():
                    raise CheckpointError(f"hot_ids has {tensor.numel()} ids, config says {self.hot_ids.numel()}")
                self.hot_ids.copy_(tensor.to(torch.long).sort().values)
                loaded.add("hot_ids")
            else:
                loaded.add(self._load_one(params, ckpt_name, name, tensor))
            self.loaded_weight_names.add(ckpt_name)
        return loaded

    def _load_one(self, params: dict, ckpt_name: str, name: str, tensor: torch.Tensor) -> str:
        """Hand one checkpoint tensor to its parameter's weight loader; the loaded name (#shard if fused)."""
        stacked = CROSS_STACKED if name.startswith("cross_attention.cross_attn.") else STACKED
        target, shard = next(
            ((name.replace(c, p), s) for p, c, s in stacked if c in name),
            (name, None),
        )
        if target not in params:
            raise CheckpointError(f"MoA checkpoint weight {ckpt_name} maps to {target}, which the model does not have")
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except (AssertionError, RuntimeError, ValueError) as e:  # SGLang's loaders assert on shapes
            raise CheckpointError(
                f"MoA checkpoint weight {ckpt_name} {list(tensor.shape)} does not fit {target} {list(param.shape)}: {e}"
            ) from e
        return target if shard is None else f"{target}#{shard}"


def expected_loaded_names(model: MoADraftModel) -> set[str]:
    """What `load_weights` must report for a complete checkpoint: plain parameters by name, fused
    ones once per shard, plus hot_ids when the checkpoint has a draft vocab."""
    out = set()
    for name, _ in model.named_parameters():
        if ".qkv_proj." in name:
            out |= {f"{name}#{s}" for s in ("q", "k", "v")}
        elif ".gate_up_proj." in name or ".kv_proj." in name:
            out |= {f"{name}#{s}" for s in (0, 1)}
        else:
            out.add(name)
    if model.cfg.draft_vocab_size:
        out.add("hot_ids")
    return out


EntryClass = [MoADraftModel]
assert MoADraftModel.__name__ == MOA_ARCH
