"""The `MOA` speculative algorithm for SGLang: server-args checks, defaults, and the worker factory.

SGLang resolves `--speculative-algorithm MOA` through `SpeculativeAlgorithm.from_string`, which
finds our registered `MoASpecAlgo`. During server-args resolution it calls, in this order,
`validate_moa_server_args` (our `validate_server_args`) and `MoASpecAlgo.handle_server_args`; both
get a stand-in of the ServerArgs whose attribute writes SGLang records as resolved values.

MoA rides SGLang's EAGLE machinery (EagleVerifyInput, the draft KV pool sized from the draft
config, per-decode slot reservation, the EAGLE branches of the scheduler), so `is_eagle()` is
True; `is_eagle3()` stays False (MoA reads the target KV cache, not aux hidden states).

Checks (each raises ValueError with the flag to change; problems of the checkpoint itself, and a draft that
does not fit the target (models/checkpoint.py check_fits), raise CheckpointError, a ValueError):
    --speculative-draft-model-path   a MoA checkpoint: config.json with architectures ["MoADraftModel"]
    MOA_SGLANG_TLI (env, optional)    integer in [0, num_target_layers]; overrides the checkpoint's tli
    steps / topk / num_draft_tokens   steps >= 1, topk >= 1, 2 <= num_draft_tokens <= tree size;
                                      topk = 1 requires num_draft_tokens = steps + 1
    tp/pp/dp 1, page_size 1, kv_cache_dtype auto, no adaptive steps, no rejection sampling,
    memory_source "lsa", target shape matches the checkpoint (when the target config is local)
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

from ..models.checkpoint import (
    EAGLE3,
    MOA,
    MOA_ARCH,
    CheckpointError,
    check_fits,
    config_kind,
    has_config,
    read_config,
    weight_files,
)
from ..models.loader import LlamaConfig
from ..models.moa import MoAConfig
from ..tree import TreeShape
from .options import MoAServerArgsError, draft_attention, tli_override

logger = logging.getLogger(__name__)

NAME = "MOA"
DEFAULT_STEPS, DEFAULT_TOPK, DEFAULT_DRAFT_TOKENS = 5, 4, 8  # SGLang's own choice for Llama targets


def read_moa_checkpoint(path) -> MoAConfig:
    """The MoA config of a draft dir. No path: MoAServerArgsError; a directory that is not a loadable MoA
    checkpoint: CheckpointError naming the flag."""
    if not path:
        raise MoAServerArgsError(
            "--speculative-algorithm MOA needs --speculative-draft-model-path DIR (a MoA checkpoint, e.g. "
            "drafters/smollm2-moa-tli1)"
        )
    flag = f"--speculative-draft-model-path {path}"
    try:
        raw = read_config(path)
    except CheckpointError as e:
        raise CheckpointError(f"{flag}: {e}; MOA needs a local MoA checkpoint directory") from e
    kind = config_kind(raw)
    if kind != MOA:
        hint = " (an EAGLE-3 head: use --speculative-algorithm EAGLE3)" if kind == EAGLE3 else ""
        raise CheckpointError(
            f'{flag} is not a MoA checkpoint: architectures={raw.get("architectures")}, expected ["{MOA_ARCH}"]{hint}'
        )
    try:
        cfg = MoAConfig.from_json(raw)
        if not weight_files(path):
            raise CheckpointError("no *.safetensors weights")
    except CheckpointError as e:
        raise CheckpointError(f"{flag}: {e}") from e
    return cfg


def tree_shape(steps, topk, num_draft_tokens) -> TreeShape:
    """Fill MoA's defaults into unset fields and check the combination."""
    if steps is None and topk is None and num_draft_tokens is None:
        steps, topk, num_draft_tokens = DEFAULT_STEPS, DEFAULT_TOPK, DEFAULT_DRAFT_TOKENS
    steps = DEFAULT_STEPS if steps is None else int(steps)
    topk = 1 if topk is None else int(topk)
    if steps < 1:
        raise MoAServerArgsError(f"--speculative-num-steps must be >= 1 for MOA, got {steps}")
    if topk < 1:
        raise MoAServerArgsError(f"--speculative-eagle-topk must be >= 1 for MOA, got {topk}")
    if num_draft_tokens is None:
        num_draft_tokens = steps + 1 if topk == 1 else min(DEFAULT_DRAFT_TOKENS, 1 + topk + (steps - 1) * topk**2)
    num_draft_tokens = int(num_draft_tokens)
    if topk == 1 and num_draft_tokens != steps + 1:
        raise MoAServerArgsError(
            f"--speculative-eagle-topk 1 drafts a chain: --speculative-num-draft-tokens must be "
            f"--speculative-num-steps + 1 = {steps + 1}, got {num_draft_tokens}"
        )
    try:
        return TreeShape(steps, topk, num_draft_tokens)
    except ValueError as e:
        raise MoAServerArgsError(
            f"MOA tree (--speculative-num-steps/--speculative-eagle-topk/--speculative-num-draft-tokens): {e}"
        ) from e


def _target_config(model_path) -> LlamaConfig | None:
    if not has_config(str(model_path)):
        return None  # a hub id: the worker checks the shapes once the target is loaded
    try:
        return LlamaConfig.from_hf(read_config(str(model_path)))
    except (KeyError, ValueError, TypeError):  # CheckpointError included: SGLang reports a bad target itself
        return None


def validate_moa_server_args(sa) -> None:
    """SGLang's validate_server_args hook: everything that needs no defaults."""
    cfg = read_moa_checkpoint(sa.speculative_draft_model_path)
    if cfg.memory_source != "lsa":
        raise MoAServerArgsError(
            f"MOA runs LSA checkpoints only; {sa.speculative_draft_model_path} has "
            f"memory_source={cfg.memory_source!r} (an ablation for the embedded engine)"
        )
    if cfg.sa_layers != 1:
        raise MoAServerArgsError(
            f"MOA runs 1 SA layer; {sa.speculative_draft_model_path} has sa_layers={cfg.sa_layers} (an ablation)"
        )
    tli_override(cfg)
    for flag, value in (("--tp-size", sa.tp_size), ("--pp-size", sa.pp_size), ("--dp-size", sa.dp_size)):
        if value not in (None, 1):
            raise MoAServerArgsError(
                f"MOA supports {flag} 1 only (LSA reads every KV head of every target layer), got {value}"
            )
    if getattr(sa, "speculative_adaptive", False):
        raise MoAServerArgsError("MOA does not support --speculative-adaptive")
    if getattr(sa, "speculative_use_rejection_sampling", False):
        raise MoAServerArgsError(
            "MOA does not support --speculative-use-rejection-sampling (tree drafts are verified by SGLang's "
            "target-only sampling)"
        )
    if getattr(sa, "enable_multi_layer_eagle", False):
        raise MoAServerArgsError("MOA does not combine with --enable-multi-layer-eagle")
    if getattr(sa, "kv_cache_dtype", "auto") not in ("auto", None):
        raise MoAServerArgsError(
            f"MOA reads the target KV cache as LSA input and needs --kv-cache-dtype auto, got {sa.kv_cache_dtype}"
        )
    if getattr(sa, "disaggregation_mode", "null") not in ("null", None):
        raise MoAServerArgsError("MOA does not support PD disaggregation")
    if getattr(sa, "speculative_draft_model_quantization", None):
        raise MoAServerArgsError("MOA does not support --speculative-draft-model-quantization")
    draft_attention()  # (a value outside the one list is refused here, before SGLang starts)
    tree_shape(sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens)
    t = _target_config(sa.model_path)
    if t is not None:
        check_fits(cfg, t, "--model-path")


class MoASpecAlgo(CustomSpecAlgo):
    """SGLang's view of MOA: EAGLE-like for the scheduler, our own defaults and worker."""

    def is_eagle(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return True  # next_draft_input carries (bs, topk) topk_p/topk_index like EAGLE's

    def carries_draft_hidden_states(self) -> bool:
        return False  # no PD disaggregation (rejected above)

    def create_future_map(
        self,
        device: torch.device,
        req_to_token_pool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def get_platform_worker_cls(self):
        return None

    def handle_server_args(self, sa) -> None:
        """Defaults, written on SGLang's stand-in (SGLang declares them as resolved values)."""
        shape = tree_shape(sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens)
        sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens = (
            shape.depth,
            shape.topk,
            shape.num_draft_tokens,
        )
        if not sa.disable_overlap_schedule:
            # NOTE: the MoA worker follows the V2 schema but has only run synchronously (never on a GPU here)
            logger.warning("MOA: overlap scheduling disabled (the MoA worker runs synchronously)")
            sa.disable_overlap_schedule = True
        if getattr(sa, "enable_mixed_chunk", False):
            logger.warning("MOA: mixed chunked prefill disabled")
            sa.enable_mixed_chunk = False
        if sa.page_size is None:
            sa.page_size = 1
        elif int(sa.page_size) != 1:
            raise MoAServerArgsError(
                f"MOA needs --page-size 1 (draft tree slots are single tokens), got {sa.page_size}"
            )
        if sa.max_running_requests is None:
            sa.max_running_requests = 48  # SGLang's default for EAGLE-family algorithms


def worker_factory(server_args):
    from .worker import MoAWorkerV2

    return MoAWorkerV2


def register_algorithm() -> None:
    """Register MOA once per process (SGLang refuses a second registration of a name)."""
    if get_spec(NAME) is not None:
        return
    SpeculativeAlgorithm.register(
        NAME, supports_overlap=False, validate_server_args=validate_moa_server_args, spec_class=MoASpecAlgo
    )(worker_factory)
