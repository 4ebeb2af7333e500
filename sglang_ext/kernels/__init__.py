"""CPU kernels, each with a torch fallback: `linear` is F.linear for every shape, faster for few rows
(and reading a weight's GGUF blocks instead of its fp32 copy when they are attached: attach_packed, or
the bf16 halves of a bf16 drafter checkpoint run in fp32: attach_bf16_halves);
the `tree_attention` op (cpu_attention.cpp) backs the "cpu" attention backend (sglang_ext/attention/cpu.py);
the layer glue ops (cpu_layer_ops.cpp) do a decoder layer's norms, RoPE + K/V store and SiLU in one
call each (models/llama.py, when uses_layer_ops); the `q8` dtype's decoder stack (cpu_q8.cpp: integer dot
products of the GGUF blocks with 8-bit activations, the whole forward in one call) is built by q8_stack.

`linear(x, w)` sends fp32 inputs with at most SMALL_ROWS rows (decode, tree verify, draft steps; 128, or
24 on AVX-512 CPUs, see _kernel_rows) to
our AVX2 kernel (cpu_linear.cpp, built by setup.py at install) and everything else (prefill,
training, bf16, autograd, non-x86 machines) to F.linear. MOA_SERVE_CPU_KERNELS=0 turns both kernels
off (same results up to fp32 rounding; used to measure what it buys).

Few rows are memory-bound: the kernel reads each weight once for all rows, from the GGUF's 4/8-bit blocks
when they are attached (`linear_packed`: fewer bytes per weight), dequantized in registers. On CPUs with
AVX-512, 3-16 rows run the same tiles two weight rows per register (same sums, half the FMAs;
MOA_SERVE_AVX512=0 keeps the AVX2 tiles), and up to 24 rows go in one pass (the weights dequantized once).
What each of these buys: scripts/kernel-ab.py (`--baseline REV` compares with another commit's kernel),
docs/BENCHMARKS.md, "CPU kernels".
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from ..settings import settings


def _cpu_flags() -> set[str]:
    try:
        return set(next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "").split())
    except OSError:
        return set()


def _load(enabled: bool) -> str | None:
    """Loads the kernel library; returns why not, or None when loaded."""
    if not enabled:
        return "disabled by MOA_SERVE_CPU_KERNELS=0"
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        return "this CPU lacks AVX2/FMA/F16C"
    libs = sorted(Path(__file__).parent.glob("_cpu_linear*.so"))
    if not libs:
        return "not built (setup.py builds it at `pip install -e .` on x86-64 Linux)"
    try:
        torch.ops.load_library(str(libs[0]))
    except OSError as e:
        return f"failed to load {libs[0].name}: {e}"
    return None


# The module globals below (UNAVAILABLE ... silu_mul) are set by _init on first use: the first access
# from outside (module __getattr__) or the first call of a function here. They stay plain globals after
# that, so tests and scripts/kernel-ab.py can swap them.
_ready = False
_LAZY = frozenset(
    "UNAVAILABLE AVAILABLE linear_small tree_attention linear_packed PACKED AVX512 SMALL_ROWS "
    "rms_norm add_rms_norm rope_store silu_mul softmax_topk".split()
)


def _init() -> None:
    """Loads the kernels and picks them per settings() (MOA_SERVE_CPU_KERNELS, _PACKED_WEIGHTS, _AVX512,
    _KERNEL_ROWS, _LAYER_OPS), once per process."""
    global _ready, UNAVAILABLE, AVAILABLE, linear_small, tree_attention, linear_packed, PACKED, AVX512, SMALL_ROWS
    global rms_norm, add_rms_norm, rope_store, silu_mul, softmax_topk
    s = settings()
    UNAVAILABLE = _load(s.cpu_kernels)  # None when the kernel is in use
    AVAILABLE = UNAVAILABLE is None
    ops = torch.ops.moa_cpu if AVAILABLE else None
    # the op `linear` calls (a module global, so scripts/kernel-ab.py can swap in another build of it)
    linear_small = ops.linear_small if AVAILABLE else None
    tree_attention = ops.tree_attention if AVAILABLE else None
    # GGUF block weights (Q4_1 / Q8_0, see cpu_linear.cpp); MOA_SERVE_PACKED_WEIGHTS=0 uses the fp32 copy
    linear_packed = getattr(ops, "linear_packed", None) if AVAILABLE else None  # None: a build older than the op
    PACKED = linear_packed is not None and s.packed_weights
    # AVX-512 tiles for 3-24-row packed matmuls where the CPU has them (same sums as the AVX2 tiles);
    # MOA_SERVE_AVX512=0 keeps the AVX2 tiles. True when in use.
    set_avx512 = getattr(ops, "set_avx512", None) if AVAILABLE else None
    AVX512 = bool(set_avx512(s.avx512)) if set_avx512 is not None else False
    SMALL_ROWS = _rows_for(AVX512)
    # the layer glue ops (cpu_layer_ops.cpp: RMSNorm, add + RMSNorm, RoPE + K/V store, SiLU * up);
    # MOA_SERVE_LAYER_OPS=0 runs the torch ops instead (to measure what they buy); uses_layer_ops reads
    # rope_store, so setting it to None turns all four off (tests and scripts/kernel-ab.py do)
    layer_ops = AVAILABLE and hasattr(ops, "rope_store") and s.layer_ops
    rms_norm = ops.rms_norm if layer_ops else None
    add_rms_norm = ops.add_rms_norm if layer_ops else None
    rope_store = ops.rope_store if layer_ops else None
    silu_mul = ops.silu_mul if layer_ops else None
    # a one-level search's softmax + top-k in one call (search.softmax_top_k)
    softmax_topk = getattr(ops, "softmax_topk", None) if layer_ops else None
    _ready = True


def q8_unavailable() -> str | None:
    """Why the q8 decoder stack (cpu_q8.cpp) cannot run here, or None when it can."""
    if not _ready:
        _init()
    if not AVAILABLE:
        return f"the CPU kernels are unavailable ({UNAVAILABLE})"
    ops = torch.ops.moa_cpu
    if not hasattr(ops, "q8_supported"):
        return "the CPU kernels were built without the q8 stack (rebuild: pip install -e .)"
    if not ops.q8_supported():
        return "this CPU lacks AVX-512 VNNI"
    return None


def q8_stack(cfg, layers, norm: torch.Tensor, lm_head: torch.Tensor):
    """The q8 decoder stack (a torch.classes.moa_cpu.Q8Stack) of a Llama-family model: `layers` (models/llama.py
    LayerWeights, whose fused weights carry their GGUF blocks: attach_packed), the final norm and the head's
    blocks. Raises ValueError naming what is missing."""
    why = q8_unavailable()
    if why is not None:
        raise ValueError(f"dtype q8: {why}")

    def blocks(w: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
        p = getattr(w, "moa_packed", None)
        if p is None or p[0] not in (PACKED_KIND_IDS["Q4_1"], PACKED_KIND_IDS["Q8_0"]):
            raise ValueError(
                f"dtype q8 needs the Q4_1/Q8_0 GGUF blocks of every layer weight and of the head; {name} has none"
            )
        return p[1], p[0]

    stack = torch.classes.moa_cpu.Q8Stack(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps
    )
    for i, lw in enumerate(layers):
        qkv, o = blocks(lw.qkv, f"layer {i} qkv"), blocks(lw.o, f"layer {i} o")
        gate_up, down = blocks(lw.gate_up, f"layer {i} gate_up"), blocks(lw.down, f"layer {i} down")
        stack.add_layer(lw.input_norm, *qkv, lw.qkv_bias, *o, lw.post_norm, *gate_up, *down)
    stack.set_head(norm, *blocks(lm_head, "the head"))
    return stack


def __getattr__(name: str):
    """The kernel globals, set on first access (PEP 562: called only for names not set yet)."""
    if name in _LAZY and not _ready:
        _init()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kernel_rows() -> int:
    """Forwards of more rows than this go to F.linear (MKL). Up to it, the kernel computes every output
    as one fixed FMA chain, so decode and verify rows are bit-identical. Where the AVX-512 tiles run
    (one pass up to 24 rows) MKL's AVX-512 sgemm catches up from 25-32 rows; on AVX2-only CPUs the
    kernel leads up to 128 (docs/BENCHMARKS.md, "CPU kernels").
    MOA_SERVE_KERNEL_ROWS overrides (128: batch-invariant up to 128 rows)."""
    if not _ready:
        _init()
    return _rows_for(AVX512)


def _rows_for(avx512: bool) -> int:
    rows = settings().kernel_rows
    return rows if rows is not None else (24 if avx512 else 128)


PACKED_KIND_IDS = {"Q4_1": 0, "Q8_0": 1, "BF16": 2}  # GGUF block type (or bf16 halves) -> the op's `kind`
PACKED_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34, "BF16": 64}  # per 32 weights


def attach_packed(w: torch.Tensor, kind: str, blocks: torch.Tensor) -> None:
    """Let `linear` read w's GGUF blocks (uint8 [N, K / 32 * block bytes]) instead of w itself. The
    caller guarantees they dequantize to exactly w (loader.write_packed_weights checks it). The blocks
    are a snapshot: once w changes in place (an optimizer step), `linear` reads w again."""
    if kind not in PACKED_KIND_IDS:
        raise ValueError(f"unsupported packed kind {kind!r}; supported: {sorted(PACKED_KIND_IDS)}")
    if (
        w.dim() != 2
        or w.shape[1] % 32
        or blocks.dtype != torch.uint8
        or blocks.shape != (w.shape[0], w.shape[1] // 32 * PACKED_BLOCK_BYTES[kind])
    ):
        raise ValueError(
            f"packed blocks {tuple(blocks.shape)} {blocks.dtype} do not fit a {kind} weight {tuple(w.shape)}"
        )
    w.moa_packed = (PACKED_KIND_IDS[kind], blocks.contiguous(), _version(w))


def attach_packed_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """dst holds src[rows] (e.g. the draft-vocab rows of the target's lm_head): let `linear` read
    the same rows of src's attached blocks, if it has any."""
    p = _packed(src)
    if p is not None:
        if dst.shape != (rows.numel(), src.shape[1]):
            raise ValueError(f"dst {tuple(dst.shape)} is not {rows.numel()} rows of src {tuple(src.shape)}")
        dst.moa_packed = (p[0], p[1][rows].contiguous(), _version(dst))


def attach_bf16_halves(module: torch.nn.Module) -> int:
    """For each fp32 Linear weight of `module` whose values are all bf16 values (a checkpoint saved in
    bf16, run in fp32), let `linear` read the bf16 halves: the same sums from half the bytes (a 1-row
    draft step streams its weights from memory). Returns how many weights were attached."""
    n = 0
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear) or m.weight.dtype != torch.float32 or m.in_features % 32:
            continue
        w = m.weight
        with torch.no_grad():
            half = w.detach().to(torch.bfloat16)
            if torch.equal(half.float(), w):
                attach_packed(w, "BF16", half.view(torch.uint8).reshape(w.shape[0], -1))
                n += 1
    return n


def q4_1_blocks(w: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [N, K] (K % 32 == 0) as GGUF Q4_1 blocks (uint8 [N, K / 32 * 20]): per 32 weights the scale d =
    (max - min) / 15 and the offset m = min (fp16 each), then q = round((w - m) / d) in 0..15 (with the fp16 d and m,
    so w ~ d q + m), weight j of a block in the low nibble of byte j, weight 16 + j in its high nibble."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"q4_1_blocks: K must be a multiple of 32, got {k}")
    b = w.detach().float().reshape(n, k // 32, 32)
    lo = b.amin(-1)
    d, m = ((b.amax(-1) - lo) / 15).half(), lo.half()
    scale = d.float()[..., None]
    q = ((b - m.float()[..., None]) / torch.where(scale > 0, scale, 1.0)).round().clamp(0, 15).to(torch.uint8)
    q = torch.where(scale > 0, q, 0)
    head = torch.stack([d, m], -1).view(torch.uint8)  # [n, k / 32, 4]: d then m, little-endian fp16
    return torch.cat([head, q[..., :16] | (q[..., 16:] << 4)], -1).reshape(n, k // 32 * 20)


def weight_blocks(w: torch.Tensor, kind: str) -> torch.Tensor:
    """An fp32 weight [N, K] as GGUF blocks of `kind` (Q8_0 or Q4_1) for the q8 kernels."""
    return q4_1_blocks(w) if kind == "Q4_1" else torch.ops.moa_cpu.q8_0_blocks(w.detach().float())


def _fused_blocks(*linears: torch.nn.Linear, kind: str = "Q8_0") -> tuple[torch.Tensor, int]:
    """The Linears' weights stacked by rows (a fused qkv or gate-up) as `kind` blocks, and the kind's id."""
    return weight_blocks(torch.cat([m.weight.detach().float() for m in linears]), kind), PACKED_KIND_IDS[kind]


def attach_q8(module: torch.nn.Module, kind: str = "Q8_0") -> int:
    """For each fp32 Linear weight of `module` (K % 32 == 0), let `linear` run it on the q8 kernels: the weight
    as `kind` blocks (Q8_0: 8 bits per weight, an fp16 scale per 32; Q4_1: 4 bits, a scale and an offset per 32)
    times 8-bit activations, as the q8 target's own matmuls (a drafter beside a q8 target: a quarter or less of
    its bf16 bytes, integer dot products). Its outputs move by the rounding of both; a drafter only proposes, so
    what is served stays the target's. Returns how many weights were attached (0 where q8 cannot run)."""
    if q8_unavailable() is not None:
        return 0
    n = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 and m.in_features % 32 == 0:
            w = m.weight
            w.moa_q8 = (_q8_matrix(weight_blocks(w, kind), kind, w.shape[1]), _version(w))
            n += 1
    return n


def q8_of(linear: torch.nn.Linear):
    """The q8 matrix attach_q8 gave linear's weight, or None (none attached, or the weight changed since)."""
    return _attached_q8(linear.weight)


def _attached_q8(w: torch.Tensor):
    q8 = getattr(w, "moa_q8", None)
    return q8[0] if q8 is not None and q8[1] == _version(w) else None


def q8_eagle3_layer(draft, kind: str = "Q8_0"):
    """An EAGLE-3 draft's midlayer (models/eagle3.py Eagle3Draft) on the q8 stack: its weights as `kind` blocks
    (q/k/v fused, gate/up fused), the layer in one call (Q8Stack.draft_layer, layer 0); None where q8 cannot run."""
    if q8_unavailable() is not None:
        return None
    c, lay = draft.cfg, draft.midlayer
    a, mlp = lay.self_attn, lay.mlp

    def blocks(*ws: torch.nn.Linear) -> tuple[torch.Tensor, int]:
        return _fused_blocks(*ws, kind=kind)

    stack = torch.classes.moa_cpu.Q8Stack(
        c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps
    )
    stack.add_eagle3_layer(
        lay.input_layernorm.weight.detach(),
        lay.hidden_norm.weight.detach(),
        *blocks(a.q_proj, a.k_proj, a.v_proj),
        *blocks(a.o_proj),
        lay.post_attention_layernorm.weight.detach(),
        *blocks(mlp.gate_proj, mlp.up_proj),
        *blocks(mlp.down_proj),
    )
    return stack


def q8_moa_stacks(draft, target, tli_layers: list[int], pass_kind: str = "Q4_1"):
    """A MoA draft (models/moa.py MoADraft) beside a q8 target (models/llama.py LlamaModel) on q8 stacks: (pass, lsa).
    `pass`: the draft pass in one call (Q8Stack.forward_layers): layer 0 SA, layer 1 CA (a cross layer), then the
    target's TLI layers (their GGUF blocks), the target's final norm, and the draft-vocab rows of its head as the
    stack's head (logits); `lsa`: the LSA layer (no head) with the commit's tail: Ekv2E and the CA keys/values of the
    memory (Q8Stack.lsa_commit: a commit of verified tokens in one call). The pass's own weights (SA, CA, the head's
    draft-vocab rows) as `pass_kind` blocks: Q4_1 as the target's layers by default, since a pass of a few rows
    streams them from memory every step (~35 % fewer bytes than Q8_0); the LSA's as Q8_0 (30 rows a token:
    compute-bound, where unpacking 4-bit blocks would cost more than it saves). The draft's
    weights as Q8_0 blocks, as attach_q8 makes them. None where q8 cannot run here or the draft's layers do not have
    the target's shape (its TLI layers could not share a stack)."""
    c, t = draft.cfg, target.cfg
    same = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps) == (
        t.hidden_size,
        t.num_heads,
        t.num_kv_heads,
        t.head_dim,
        t.intermediate_size,
        t.rms_norm_eps,
    )
    head = getattr(target.lm_head, "moa_packed", None)
    if q8_unavailable() is not None or target.q8 is None or not same or c.memory_source != "lsa" or head is None:
        return None

    def norm(m) -> torch.Tensor:
        return m.weight.detach().float()

    def decoder(stack, lay, kind: str) -> None:
        a, mlp = lay.attn, lay.mlp
        qkv, o = _fused_blocks(a.q_proj, a.k_proj, a.v_proj, kind=kind), _fused_blocks(a.o_proj, kind=kind)
        gu, down = _fused_blocks(mlp.gate_proj, mlp.up_proj, kind=kind), _fused_blocks(mlp.down_proj, kind=kind)
        stack.add_layer(norm(lay.input_layernorm), *qkv, None, *o, norm(lay.post_attention_layernorm), *gu, *down)

    step = torch.classes.moa_cpu.Q8Stack(
        c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps
    )
    decoder(step, draft.self_attention, pass_kind)
    ca = draft.cross_attention
    a, mlp = ca.attn, ca.mlp
    step.add_cross_layer(
        norm(ca.input_layernorm),
        *_fused_blocks(a.q_proj, kind=pass_kind),
        *_fused_blocks(a.o_proj, kind=pass_kind),
        norm(ca.post_attention_layernorm),
        *_fused_blocks(mlp.gate_proj, mlp.up_proj, kind=pass_kind),
        *_fused_blocks(mlp.down_proj, kind=pass_kind),
    )
    for li in tli_layers:
        lw = target.layers[li]
        packed = [lw.qkv.moa_packed, lw.o.moa_packed, lw.gate_up.moa_packed, lw.down.moa_packed]
        (qkv, qk), (o, ok), (gu, gk), (down, dk) = ((p[1], p[0]) for p in packed)
        step.add_layer(lw.input_norm, qkv, qk, lw.qkv_bias, o, ok, lw.post_norm, gu, gk, down, dk)
    if pass_kind == "Q4_1":
        step.set_head(target.norm, q4_1_blocks(target.lm_head[draft.hot_ids].float()), PACKED_KIND_IDS["Q4_1"])
    else:
        step.set_head(target.norm, head[1][draft.hot_ids].contiguous(), head[0])
    lay = draft.layer_self_attention
    lsa = torch.classes.moa_cpu.Q8Stack(
        c.lsa_hidden, lay.heads, lay.kv_heads, lay.head_dim, c.lsa_intermediate_size, c.rms_norm_eps
    )
    decoder(lsa, lay, "Q8_0")
    e, kv = draft.Ekv2E, _fused_blocks(a.k_proj, a.v_proj)
    lsa.set_lsa_tail(*_fused_blocks(e), e.bias.detach().float(), norm(ca.kv_layernorm), *kv, ca.kv_heads, ca.head_dim)
    return step, lsa


def attach_q8_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> bool:
    """dst holds src[rows] (the draft-vocab rows of a q8 target's head): let `linear` run those rows of src's
    GGUF blocks on the q8 kernels. Returns whether it did (src has Q4_1/Q8_0 blocks and q8 runs here)."""
    p = getattr(src, "moa_packed", None)
    if q8_unavailable() is not None or p is None or p[0] not in (PACKED_KIND_IDS["Q4_1"], PACKED_KIND_IDS["Q8_0"]):
        return False
    kind = "Q4_1" if p[0] == PACKED_KIND_IDS["Q4_1"] else "Q8_0"
    dst.moa_q8 = (_q8_matrix(p[1][rows].contiguous(), kind, src.shape[1]), _version(dst))
    return True


def _q8_matrix(blocks: torch.Tensor, kind: str, k: int):
    return torch.classes.moa_cpu.Q8Matrix(blocks, PACKED_KIND_IDS[kind], k)


def _version(w: torch.Tensor) -> int | None:
    """w's in-place update counter (inference tensors keep none)."""
    return None if w.is_inference() else w._version


def _packed(w: torch.Tensor):
    """w's attached blocks, unless w changed in place since they were attached."""
    if not _ready:
        _init()
    p = getattr(w, "moa_packed", None) if PACKED else None
    return p if p is not None and p[2] == _version(w) else None


def uses_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not _ready:
        _init()
    return (
        AVAILABLE
        and x.dim() >= 1
        and x.numel() <= SMALL_ROWS * x.shape[-1]
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.shape[1] % 8 == 0
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def _q8_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x may go to w's q8 matrix (attach_q8): fp32 on the CPU, no autograd through either, rows of any count."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def uses_layer_ops(x: torch.Tensor) -> bool:
    """Whether a decoder layer over hidden states x [T, H] can run on the layer glue ops."""
    if not _ready:
        _init()
    return (
        rope_store is not None
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[-1] % 8 == 0
        and x.stride(-1) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def gpu_layer_ops_for(device: torch.device) -> bool:
    """Whether a model on `device` runs its decoder layers on the Triton layer ops (triton_layer_ops.py):
    a CUDA device with triton installed; MOA_SERVE_LAYER_OPS=0 keeps the torch ops."""
    import importlib.util

    has_triton = importlib.util.find_spec("triton") is not None
    return torch.device(device).type == "cuda" and settings().layer_ops and has_triton


# Device types that take the GPU's kernel paths besides CUDA: "meta" while a benchmark counts the launches a
# step would make on a GPU without one (moa_serve/benchmarks/step_ops.py: launches counted, never run)
_GPU_STAND_INS: set[str] = set()


@contextlib.contextmanager
def gpu_stand_in(device_type: str = "meta"):
    """While inside, tensors on `device_type` take the GPU's kernel paths (the Triton layer ops of a model
    whose gpu_layer_ops is set, the static attention's Triton kernel): for counting launches only."""
    _GPU_STAND_INS.add(device_type)
    try:
        yield
    finally:
        _GPU_STAND_INS.discard(device_type)


def on_gpu(t: torch.Tensor) -> bool:
    """Whether t takes the GPU's kernel paths: a CUDA tensor, or one on a stand-in (gpu_stand_in)."""
    return t.device.type == "cuda" or t.device.type in _GPU_STAND_INS


def uses_gpu_layer_ops(x: torch.Tensor) -> bool:
    """Whether hidden states x [T, H] fit the Triton layer ops: inference only (they have no backward)."""
    return on_gpu(x) and x.dim() == 2 and not (torch.is_grad_enabled() and x.requires_grad)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias): x [.., K], w [N, K] -> [.., N]."""
    q8 = _attached_q8(w)
    if q8 is not None and _q8_fits(x, w):
        y = q8.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias
    if not uses_kernel(x, w):
        return F.linear(x, w, bias)
    packed = _packed(w)
    x2 = x.reshape(-1, x.shape[-1])
    y = (linear_small(x2, w) if packed is None else linear_packed(x2, packed[1], packed[0])).view(
        *x.shape[:-1], w.shape[0]
    )
    return y if bias is None else y + bias


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """linear(x, w) without the checks, for callers that made them once per layer: x 2-D fp32 on the
    CPU with at most SMALL_ROWS rows, no autograd, w fp32 with K % 8 == 0 (the decoder layer on the
    layer ops; ~8 us of checks and reshapes per matmul, ~1 ms of a bs-1 step). The target's weights
    are frozen, so the attached blocks are read without _packed's staleness check."""
    if not _ready:
        _init()
    packed = getattr(w, "moa_packed", None) if PACKED else None
    return linear_small(x, w) if packed is None else linear_packed(x, packed[1], packed[0])


class Linear(torch.nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose few-row inference calls use the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
