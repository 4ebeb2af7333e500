"""Llama-family forward (Llama 2/3, SmolLM2, Qwen2, Mistral) over a slot-based KV pool.

Plain tensors, no framework: weights are fused once (qkv, gate_up) at load. One forward serves
prefill, decode and tree verification; they differ only in the attention plan and positions.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from ..attention import AttentionFn, AttentionPlan, select_backend
from ..attention.cpu import tree_attention_cpu
from ..device import to_device
from ..kernels import attach_packed, linear
from .kv_pool import KVPool
from .loader import LlamaConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq+2Hkv)*D, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, Hq*D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, H] after the final norm
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> [T, H] output of that layer


@dataclass
class PaddedOutput:
    hidden: torch.Tensor  # [B, T, H] after the final norm
    captured: dict[int, torch.Tensor]  # layer index -> [B, T, H] output of that layer
    k: list[torch.Tensor]  # per layer [B, T, Hkv, D] keys as cached (after RoPE); empty unless keep_kv
    v: list[torch.Tensor]  # per layer [B, T, Hkv, D]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class RMSNorm(nn.Module):
    """rms_norm as a module with its weight (the draft heads' norms, trained and loaded by name)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if _uses_norm_kernel(rows, self.weight):
            # NOTE: drafting (fp32, no autograd): one call instead of six torch ops; a draft step of
            # a few rows is mostly per-op overhead (the same formula; the mean's sum order differs)
            return kernels.rms_norm(rows, self.weight, self.eps).view(x.shape)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def _uses_norm_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The layer-ops check for x (any leading dims, as rows) plus the norm's weight: fp32, and no
    autograd through it either."""
    return (
        kernels.uses_layer_ops(x.reshape(-1, x.shape[-1]))
        and w.dtype == torch.float32
        and w.is_contiguous()
        and not (torch.is_grad_enabled() and w.requires_grad)
    )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    if sc.get("rope_type", sc.get("type")) == "llama3":
        # Llama-3.1 frequency-dependent scaling
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif sc.get("rope_type", sc.get("type")) == "linear":
        inv = inv / sc["factor"]
    return inv.float()


# RoPE on the CPU: the cos/sin of every position up to a model's max_position are made once (while both tables fit
# ROPE_TABLE_BYTES) and a call's rows are then one index each: the ~8 small ops of computing them cost more than
# their arithmetic once a step's weight stream has evicted the caches, and a position's values no longer depend on
# what else is in the call. (On a GPU they are computed per call: a graph replays them.)
ROPE_TABLE_BYTES = 32 * 2**20
ROPE_SLACK = 64  # table rows past max_position: a draft tree's nodes may sit a few positions past a sequence's end


def rope_of(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., 1, D] of positions [...], computed."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_cos_sin(
    inv_freq: torch.Tensor,  # [D / 2]
    positions: torch.Tensor,  # [...] int
    dtype: torch.dtype,
    tables: dict,  # the caller's tables by dtype (filled here)
    max_position: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., 1, D] of the positions (halves duplicated, HF rotate_half convention): a table's rows on the CPU,
    computed elsewhere or where the table would not fit."""
    if positions.device.type != "cpu" or inv_freq.device.type != "cpu":
        return rope_of(inv_freq, positions, dtype)
    table = tables.get(dtype)
    if table is None:
        n = max_position + ROPE_SLACK
        if 2 * n * 2 * inv_freq.numel() * dtype.itemsize > ROPE_TABLE_BYTES:
            return rope_of(inv_freq, positions, dtype)
        with torch.inference_mode(False), torch.no_grad():  # (usable outside inference mode too: training)
            table = tables[dtype] = rope_of(inv_freq, torch.arange(n), dtype)
    return table[0][positions], table[1][positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D] (halves duplicated, HF rotate_half convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class LlamaModel:
    """The target (or a layer subset of it, for self-drafting)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        state: dict[str, torch.Tensor],
        dtype=torch.float32,
        device="cpu",
        attention: AttentionFn | None = None,
        packed: dict[str, tuple[str, torch.Tensor]] | None = None,
        q8: bool = False,
    ):
        """packed: GGUF blocks of some weights (loader.load_packed_weights); few-row fp32 matmuls on the
        CPU read them instead of the fp32 weight (same results, 6x fewer bytes).
        q8: the `q8` dtype (fp32 model, CPU, every layer weight and the head with GGUF blocks): the matmuls
        are integer dot products of the blocks with activations quantised to 8 bits per 32 values, and a
        decode or verify forward is one call (kernels/cpu_q8.cpp); ValueError where that cannot run."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        packed = packed or {}
        # the fastest correct backend for the device unless one is given (torch SDPA on CPU, Triton on CUDA)
        self.attention = attention or select_backend(device)

        def w(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"missing weight {name}")
            return state[name].to(device=device, dtype=dtype).contiguous()

        def weight(*names: str) -> torch.Tensor:
            """The weights `names` stacked by rows (fused qkv, gate_up), with their GGUF blocks attached
            when every part has them, in one block type."""
            t = torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])
            parts = [packed.get(n) for n in names]
            if self.device.type == "cpu" and all(parts) and len({k for k, _ in parts}) == 1:
                attach_packed(t, parts[0][0], torch.cat([b for _, b in parts]))
            return t

        self.embed = weight("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = (
            self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in state else weight("lm_head.weight")
        )
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if cfg.attention_bias else None
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=weight(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                    qkv_bias=bias,
                    o=weight(p + "self_attn.o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=weight(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=weight(p + "mlp.down_proj.weight"),
                )
            )
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self._rope_tables: dict = {}  # (rope_cos_sin; shared by subsets)
        # every layer matmul fits the small-rows kernel (fp32, K % 8 == 0):
        # _layer_forward_ops may skip linear()'s checks
        self._rows_kernel = (
            kernels.AVAILABLE
            and self.device.type == "cpu"
            and dtype == torch.float32
            and all(n % 8 == 0 for n in (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size))
        )
        self.scale = cfg.head_dim**-0.5
        # decoder layers on the GPU's fused Triton kernels (five a layer instead of ~30); off where Triton
        # cannot run (fake CUDA tensors in tests set it off, as they set the torch attention)
        self.gpu_layer_ops = kernels.gpu_layer_ops_for(self.device)
        # the q8 decoder stack and, per entry of self.layers, its layer in the stack (a subset keeps the indices)
        self.q8 = None
        if q8:
            if self.device.type != "cpu" or dtype != torch.float32:
                raise ValueError("dtype q8 runs on the CPU only")
            self.q8 = kernels.q8_stack(cfg, self.layers, self.norm, self.lm_head)
        self.stack_ids = list(range(len(self.layers)))

    def subset(self, layer_ids: list[int]) -> "LlamaModel":
        """A model made of some of this model's layers (weights shared, not copied), same embed/norm/head."""
        sub = copy.copy(self)
        sub.layers = [self.layers[i] for i in layer_ids]
        sub.stack_ids = [self.stack_ids[i] for i in layer_ids]
        return sub

    @property
    def dtype_name(self) -> str:
        """What --dtype names this model's numerics: q8, float32, bfloat16, ..."""
        return "q8" if self.q8 is not None else str(self.dtype).removeprefix("torch.")

    # --- pieces -------------------------------------------------------------------------------
    def new_kv_pool(self, num_slots: int, num_layers: int | None = None) -> KVPool:
        c = self.cfg
        return KVPool(num_layers or len(self.layers), num_slots, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of positions [T], in the model's dtype (rope_cos_sin)."""
        positions = to_device(positions, self.inv_freq.device)
        return rope_cos_sin(self.inv_freq, positions, self.dtype, self._rope_tables, self.cfg.max_position)

    def layer_forward(
        self,
        i: int,
        x: torch.Tensor,
        rope,
        slots: torch.Tensor,
        plan: AttentionPlan,
        kv: KVPool,
        kv_layer: int | None = None,
    ) -> torch.Tensor:
        c, lw = self.cfg, self.layers[i]
        li = i if kv_layer is None else kv_layer
        if self.q8 is not None:
            return self._layer_forward_q8(i, x, rope, slots, plan, kv.k[li], kv.v[li])
        if kernels.uses_layer_ops(x) and kv.k[li].dtype == lw.qkv.dtype == torch.float32 and c.head_dim % 16 == 0:
            return self._layer_forward_ops(lw, x, rope, slots, plan, kv.k[li], kv.v[li])
        if self.gpu_layer_ops and kernels.uses_gpu_layer_ops(x) and kv.k[li].dtype == x.dtype:
            half = c.head_dim // 2  # the fused qkv kernel's tile is a half head: a power of two >= 16
            fits = half >= 16 and not half & (half - 1)
            layer = self._layer_forward_fused if fits else self._layer_forward_unfused
            return layer(lw, x, rope, slots, plan, kv.k[li], kv.v[li])
        return self._layer_forward_torch(lw, x, rope, slots, plan, kv, li)

    def _layer_forward_torch(self, lw: LayerWeights, x, rope, slots, plan, kv: KVPool, li: int) -> torch.Tensor:
        """layer_forward in torch ops (any device and dtype, autograd included)."""
        c, t = self.cfg, x.shape[0]
        h = rms_norm(x, lw.input_norm, c.rms_norm_eps)
        qkv = linear(h, lw.qkv, lw.qkv_bias)
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[:, :nq].view(t, c.num_heads, c.head_dim)
        k = qkv[:, nq : nq + nk].view(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, nq + nk :].view(t, c.num_kv_heads, c.head_dim)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(li, slots, k, v)
        a = self.attention(q, kv.k[li], kv.v[li], plan, self.scale)
        x = x + linear(a.reshape(t, nq), lw.o)
        h = rms_norm(x, lw.post_norm, c.rms_norm_eps)
        gu = linear(h, lw.gate_up)
        inter = gu.shape[-1] // 2
        return x + linear(F.silu(gu[:, :inter]) * gu[:, inter:], lw.down)

    def _layer_forward_ops(self, lw: LayerWeights, x, rope, slots, plan, k_pool, v_pool) -> torch.Tensor:
        """layer_forward on the layer glue ops (kernels/cpu_layer_ops.cpp): the same computation,
        5 calls around the 4 matmuls and the attention instead of ~30 torch ops."""
        c = self.cfg
        cos, sin = rope
        # few rows (decode, verify, draft): the kernel without linear()'s per-call checks, made here once
        lin = kernels.linear_rows if self._rows_kernel and x.shape[0] <= kernels.SMALL_ROWS else linear
        h = kernels.rms_norm(x, lw.input_norm, c.rms_norm_eps)
        qkv = lin(h, lw.qkv)
        if lw.qkv_bias is not None:
            qkv = qkv + lw.qkv_bias
        q = kernels.rope_store(
            qkv, cos[:, 0], sin[:, 0], k_pool, v_pool, slots.contiguous(), c.num_heads, c.num_kv_heads
        )
        a = self.attention(q, k_pool, v_pool, plan, self.scale)
        x, h = kernels.add_rms_norm(x, lin(a.reshape(x.shape[0], -1), lw.o), lw.post_norm, c.rms_norm_eps)
        return x + lin(kernels.silu_mul(lin(h, lw.gate_up)), lw.down)

    def _layer_forward_q8(self, i: int, x, rope, slots, plan, k_pool, v_pool) -> torch.Tensor:
        """layer_forward on the q8 stack: norm, qkv, RoPE and the K/V store in one call, the attention, then
        o, the residual, norm, SiLU MLP in another; the rows' bits are what the one-call forward gives them."""
        cos, sin = rope
        sid = self.stack_ids[i]
        x = x.contiguous()
        q = self.q8.layer_qkv(x, sid, cos[:, 0], sin[:, 0], k_pool, v_pool, slots.contiguous())
        if self.attention is tree_attention_cpu:  # the stack's attention for every row, prompt blocks too
            a = self.q8.attention(
                q, k_pool, v_pool, plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.custom_mask, self.scale
            )
        else:
            a = self.attention(q, k_pool, v_pool, plan, self.scale)
        return self.q8.layer_out(x, a.reshape(x.shape[0], -1), sid)

    def _forward_q8(self, x, rope, out_slots, plan, kv, capture_layers, layers, offset) -> ForwardOutput | None:
        """The whole stack in one call on the CPU attention backend (None: another backend, the per-layer path).
        Prompt blocks too: the attention kernel computes each row alone, so a row's bits depend on its token,
        position and the K/V it sees, not on the batch, on chunked prefill or on the drafter. (q8 rounds every
        matmul input to 8 bits, which turns the few-ulp differences of a batched torch attention into visibly
        different logits; SDPA would prefill long prompts faster.)"""
        if self.attention is not tree_attention_cpu:
            return None
        order = list(layers) if layers is not None else list(range(len(self.layers)))
        kv_ids = [i - offset for i in order]
        at = [p for p, i in enumerate(order) if i in capture_layers]
        cos, sin = rope
        out = self.q8.forward(
            x.contiguous(),
            cos[:, 0],
            sin[:, 0],
            out_slots.contiguous(),
            [kv.k[i] for i in kv_ids],
            [kv.v[i] for i in kv_ids],
            [self.stack_ids[i] for i in order],
            plan.qo_indptr,
            plan.kv_indptr,
            plan.kv_indices,
            plan.custom_mask,
            self.scale,
            at,
        )
        return ForwardOutput(out[0], {order[p]: h for p, h in zip(at, out[1:])})

    def _layer_forward_fused(self, lw: LayerWeights, x, rope, slots, plan, k_pool, v_pool) -> torch.Tensor:
        """layer_forward on a GPU's fused Triton kernels (kernels/triton_layer_ops.py): the same computation
        in five kernels: the input norm with the qkv matmul, RoPE and the K/V store; the attention; the
        o matmul with the residual; the post norm with the gate-up matmul and SiLU * up; the down matmul
        with the residual (`_layer_forward_unfused` is the same in ten, the tests' reference)."""
        from ..kernels import triton_layer_ops as ops

        c = self.cfg
        cos, sin = rope
        slots = to_device(slots, x.device)
        q = ops.norm_qkv_rope_store(
            x, lw.input_norm, c.rms_norm_eps, lw.qkv, lw.qkv_bias, cos[:, 0], sin[:, 0], k_pool, v_pool, slots,
            c.num_heads, c.num_kv_heads,
        )  # fmt: skip
        a = self.attention(q, k_pool, v_pool, plan, self.scale)
        x = ops.linear_residual(a.reshape(x.shape[0], -1), lw.o, x)
        return ops.linear_residual(ops.norm_gate_up_silu(x, lw.post_norm, c.rms_norm_eps, lw.gate_up), lw.down, x)

    def _layer_forward_unfused(self, lw: LayerWeights, x, rope, slots, plan, k_pool, v_pool) -> torch.Tensor:
        """_layer_forward_fused in ten kernels (two norms, RoPE + K/V store, SiLU * up, four matmuls, the
        attention, an add): the per-op Triton layer ops the fused kernels are tested against."""
        from ..kernels import triton_layer_ops as ops

        c = self.cfg
        cos, sin = rope
        h = ops.rms_norm(x, lw.input_norm, c.rms_norm_eps)
        qkv = linear(h, lw.qkv, lw.qkv_bias)
        slots = to_device(slots, x.device)
        q = ops.rope_store(qkv, cos[:, 0], sin[:, 0], k_pool, v_pool, slots, c.num_heads, c.num_kv_heads)
        a = self.attention(q, k_pool, v_pool, plan, self.scale)
        x, h = ops.add_rms_norm(x, linear(a.reshape(x.shape[0], -1), lw.o), lw.post_norm, c.rms_norm_eps)
        return x + linear(ops.silu_mul(linear(h, lw.gate_up)), lw.down)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        out_slots: torch.Tensor,  # [T] where each token's K/V is written
        plan: AttentionPlan,
        kv: KVPool,
        capture_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        x = self.embed[input_ids]
        return self.forward_embeds(x, positions, out_slots, plan, kv, capture_layers)

    @torch.inference_mode()
    def forward_embeds(
        self,
        x,
        positions,
        out_slots,
        plan,
        kv,
        capture_layers=(),
        layers: range | None = None,
        kv_layer_offset: int = 0,
    ) -> ForwardOutput:
        rope = self.rope(positions)
        if self.q8 is not None:
            out = self._forward_q8(x, rope, out_slots, plan, kv, capture_layers, layers, kv_layer_offset)
            if out is not None:
                return out
        captured = {}
        for i in layers if layers is not None else range(len(self.layers)):
            x = self.layer_forward(i, x, rope, out_slots, plan, kv, kv_layer=i - kv_layer_offset)
            if i in capture_layers:
                captured[i] = x
        norm = kernels.rms_norm if kernels.uses_layer_ops(x) or self.q8 is not None else rms_norm
        if self.gpu_layer_ops and kernels.uses_gpu_layer_ops(x):
            from ..kernels import triton_layer_ops

            norm = triton_layer_ops.rms_norm
        return ForwardOutput(norm(x, self.norm, self.cfg.rms_norm_eps), captured)

    @torch.no_grad()  # not inference_mode: the outputs are training targets that autograd saves
    def forward_padded(
        self, input_ids: torch.Tensor, capture_layers: tuple[int, ...] = (), keep_kv: bool = False
    ) -> PaddedOutput:
        """A causal forward over right-padded sequences input_ids [B, T] (positions 0..T-1), no KV pool:
        the training-time target run on an accelerator (SDPA's fused causal kernels). Padding sits
        after each sequence's last token, so causal attention never lets a real token see it."""
        c = self.cfg
        b, t = input_ids.shape
        x = self.embed[input_ids]
        rope = self.rope(torch.arange(t, device=self.device))
        cos, sin = (r[None] for r in rope)  # [1, T, 1, D]
        captured, ks, vs = {}, [], []
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, lw in enumerate(self.layers):
            h = rms_norm(x, lw.input_norm, c.rms_norm_eps)
            qkv = F.linear(h, lw.qkv, lw.qkv_bias)
            q = apply_rope(qkv[..., :nq].unflatten(-1, (c.num_heads, c.head_dim)), cos, sin)
            k = apply_rope(qkv[..., nq : nq + nk].unflatten(-1, (c.num_kv_heads, c.head_dim)), cos, sin)
            v = qkv[..., nq + nk :].unflatten(-1, (c.num_kv_heads, c.head_dim))
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                scale=self.scale,
                enable_gqa=c.num_heads != c.num_kv_heads,
            )
            x = x + F.linear(a.transpose(1, 2).flatten(-2), lw.o)
            h = rms_norm(x, lw.post_norm, c.rms_norm_eps)
            gu = F.linear(h, lw.gate_up)
            inter = gu.shape[-1] // 2
            x = x + F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], lw.down)
            if i in capture_layers:
                captured[i] = x
            if keep_kv:
                ks.append(k)
                vs.append(v)
        return PaddedOutput(rms_norm(x, self.norm, c.rms_norm_eps), captured, ks, vs)

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """fp32=False keeps the model dtype: argmax needs no upcast (exact), and the upcast of
        [nodes, vocab] logits is a visible share of a CPU verify step; samplers upcast themselves."""
        if self.q8 is not None:
            return self.q8.logits(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)
        out = linear(hidden, self.lm_head)
        return out.float() if fp32 else out
