"""MoA on SGLang's v2 speculative worker schema (EAGLEWorkerV2 / EagleDraftWorker, sglang 0.5.23).

NOT RUN: this module needs a CUDA device and SGLang's kernels; it has never executed on the
CPU-only machine it was written on. Its math is drafters/moa_core.py, the embedded MoA drafter's
own, over SGLang's slot pools (draft_core.py, checked on CPU against the embedded drafter); its index
handling is layout.py (checked on CPU); this file is the glue.

One decode iteration, as EAGLEWorkerV2.forward_batch_generation drives it:

    draft()                     MoADraftWorker.draft: moa_draft over req_to_token / the pools ->
                                (parent_list, top_scores_index, draft_tokens) -> SGLang's own
                                build_eagle_verify_input -> EagleVerifyInput (SGLang's tree layout)
    verify()                    unchanged EAGLE verify (target forward with the tree mask, sampling,
                                accepted path moved to the front of the verify window)
    _draft_extend_for_decode    MoA commit: LSA over the accepted tokens' K/V from all target layers
                                (token_to_kv_pool.get_key_buffer/get_value_buffer at their slots),
                                CA and SA K/V written to the draft pool at the same slots

After a prefill, _draft_extend_for_prefill commits every extended token. The draft KV pool (made
by SGLang from the draft config: 2 layers = SA, CA) shares slot numbers with the target, so
radix-cache sharing and freeing need nothing from us. No draft CUDA graphs (the draft runs eager;
the target verify keeps SGLang's graphs). Overlap scheduling is disabled by the algorithm.
"""

from __future__ import annotations

import torch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.runtime_context import get_device, get_schedule, get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput
from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2
from sglang.srt.speculative.pp_draft_embedding import resolve_target_embed_and_head
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import get_plan_stream

from ..models.checkpoint import check_fits
from ..models.loader import LlamaConfig
from .draft_core import MoAPools, moa_commit, moa_draft
from .hf_config import CA_KV_LAYER, SA_KV_LAYER
from .layout import committed_after_extend, committed_after_verify
from .options import tli_override
from .tree_attention import select_tree_attention


def _target_layers(model) -> list:
    """The decoder layers of an SGLang Llama-family target (LlamaForCausalLM and relatives)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"MOA needs a Llama-family target (model.model.layers); {type(model).__name__} has none")
    return list(layers)


def sglang_tli_layer(layer, layer_id: int, kv_pool, attention):
    """A TLILayer over one SGLang Llama decoder layer: its norms/projections/RoPE/MLP, our tree
    attention over the target pool (RadixAttention needs a ForwardBatch, which the draft has not)."""
    attn = layer.self_attn
    for name in (
        "qkv_proj",
        "o_proj",
        "rotary_emb",
        "q_size",
        "kv_size",
        "scaling",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
        if not hasattr(attn, name):
            raise ValueError(f"MOA TLI: target layer {layer_id} ({type(layer).__name__}) lacks self_attn.{name}")

    def run(x: torch.Tensor, positions: torch.Tensor, node_slots: torch.Tensor, plan) -> torch.Tensor:
        qkv = attn.qkv_proj(layer.input_layernorm(x))[0]
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        k_buf, v_buf = kv_pool.get_key_buffer(layer_id), kv_pool.get_value_buffer(layer_id)
        k_buf[node_slots] = k.reshape(-1, attn.num_kv_heads, attn.head_dim).to(k_buf.dtype)
        v_buf[node_slots] = v.reshape(-1, attn.num_kv_heads, attn.head_dim).to(v_buf.dtype)
        o = attention(q.reshape(-1, attn.num_heads, attn.head_dim), k_buf, v_buf, plan, attn.scaling)
        x = x + attn.o_proj(o.reshape(o.shape[0], -1))[0]
        return x + layer.mlp(layer.post_attention_layernorm(x))

    return run


class MoADraftWorker(EagleDraftWorker):
    """EagleDraftWorker whose draft/extend steps are MoA's. The parent's constructor builds the
    draft TpModelWorker, i.e. SGLang loads MoADraftModel from --speculative-draft-model-path and
    makes its two-layer KV pool."""

    def __init__(self, server_args: ServerArgs, gpu_id: int, nccl_port: int, target_worker: TpModelWorker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self.moa = self.draft_runner.model
        cfg = self.moa.cfg
        self.tli = tli_override(cfg)
        hf = target_worker.model_runner.model_config.hf_text_config
        check_fits(cfg, LlamaConfig.from_hf(hf.to_dict()), "the target model")
        self.attention = select_tree_attention(self.device)
        layers = _target_layers(target_worker.model_runner.model)
        self.tli_layer_ids = list(range(len(layers) - self.tli, len(layers)))

    # --- set-up the EAGLE parent would do differently ------------------------------------------
    def init_token_map(self):
        self.hot_token_id = None  # the MoA checkpoint carries its own draft vocab (hot_ids)

    def init_lm_head(self):
        target = self.target_worker.model_runner.model
        embed, head = resolve_target_embed_and_head(target)
        if embed is None or head is None:
            raise ValueError("MOA needs the target's input embedding and lm_head on this rank")
        self.embed = embed
        self.hot_ids = self.moa.hot_ids.to(head.device)
        self.head = head[self.hot_ids].contiguous()
        norm = target.model.norm
        self.final_norm = lambda x: norm(x)
        target_pool = self.target_worker.model_runner.token_to_kv_pool
        layers = _target_layers(target)
        self.tli_layers = [sglang_tli_layer(layers[i], i, target_pool, self.attention) for i in self.tli_layer_ids]

    def init_attention_backends(self):
        # The draft passes use our tree attention (tree_attention.py), not SGLang draft backends.
        self.draft_attn_backend = None
        self.draft_extend_attn_backend = None

    def init_attention_backend(self):
        self.init_attention_backends()

    def init_cuda_graphs(self):
        self.cuda_graph_runner = None
        self.cuda_graph_runner_for_draft_extend = None

    def _capture_cuda_graphs(self):
        self.init_cuda_graphs()

    def pools(self) -> MoAPools:
        draft_pool = self.draft_runner.token_to_kv_pool
        target_pool = self.target_worker.model_runner.token_to_kv_pool
        n = self.target_worker.model_runner.model_config.num_hidden_layers
        return MoAPools(
            sa_k=draft_pool.get_key_buffer(SA_KV_LAYER),
            sa_v=draft_pool.get_value_buffer(SA_KV_LAYER),
            ca_k=draft_pool.get_key_buffer(CA_KV_LAYER),
            ca_v=draft_pool.get_value_buffer(CA_KV_LAYER),
            target_k=[target_pool.get_key_buffer(i) for i in range(n)],
            target_v=[target_pool.get_value_buffer(i) for i in range(n)],
        )

    # --- the three steps ---------------------------------------------------------------------------
    def draft(self, batch, *, with_topology: bool = False):
        if with_topology:
            raise NotImplementedError("MOA does not support pipeline parallelism (pp_size 1 only)")
        draft_input: EagleDraftInput = batch.spec_info
        if batch.forward_mode.is_idle():
            return EagleVerifyInput.create_idle_input(
                self.topk, self.speculative_num_steps, self.speculative_num_draft_tokens, self.device
            )
        parent_list, top_scores_index, draft_tokens = moa_draft(
            self.moa,
            self.embed,
            self.head,
            self.hot_ids,
            self.final_norm,
            self.tli_layers,
            self.pools(),
            self.attention,
            self.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            draft_input.bonus_tokens,
            self.topk,
            self.speculative_num_steps,
            self.speculative_num_draft_tokens,
            self.moa.cfg.sa_tree_attention,
        )
        return build_eagle_verify_input(
            batch,
            draft_input,
            parent_list,
            top_scores_index,
            draft_tokens,
            None,
            target_worker=self.target_worker,
            topk=self.topk,
            num_steps=self.speculative_num_steps,
            num_draft_tokens=self.speculative_num_draft_tokens,
            tree_mask_mode=self.tree_mask_mode,
            device=self.device,
        )

    def _next_draft_input(self, bonus_tokens: torch.Tensor) -> EagleDraftInput:
        """Shape-valid EAGLE fields (the scheduler relays them); MoA's draft needs only the bonus."""
        bs = bonus_tokens.shape[0]
        return EagleDraftInput(
            topk_p=torch.ones(bs, self.topk, dtype=torch.float32, device=self.device),
            topk_index=torch.zeros(bs, self.topk, dtype=torch.int64, device=self.device),
            hidden_states=torch.zeros(bs, self.moa.cfg.hidden_size, dtype=self.embed.dtype, device=self.device),
            bonus_tokens=bonus_tokens,
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )

    def _draft_extend_for_prefill(
        self, batch, target_hidden_states, next_token_ids, mm_input_embeds=None, kv_loc_plan=None
    ):
        if not batch.forward_mode.is_idle():
            slots, positions, tokens = committed_after_extend(
                batch.out_cache_loc, batch.input_ids, batch.prefix_lens, batch.extend_lens
            )
            moa_commit(self.moa, self.embed, self.pools(), slots, positions, tokens)
        return self._next_draft_input(next_token_ids)

    def _draft_extend_for_decode(self, batch, batch_result, *, kv_loc_plan=None):
        nxt = batch_result.next_draft_input
        if not batch.forward_mode.is_idle():
            verify_input: EagleVerifyInput = batch.spec_info
            slots, positions, tokens, _ = committed_after_verify(
                batch.out_cache_loc,
                batch_result.accept_index,
                batch_result.accept_lens,
                batch.seq_lens,
                verify_input.draft_token,
                self.speculative_num_draft_tokens,
            )
            moa_commit(self.moa, self.embed, self.pools(), slots, positions, tokens)
        filled = self._next_draft_input(nxt.bonus_tokens)
        nxt.topk_p, nxt.topk_index, nxt.hidden_states = filled.topk_p, filled.topk_index, filled.hidden_states


class MoAWorkerV2(EAGLEWorkerV2):
    """EAGLEWorkerV2 with MoADraftWorker as its draft worker (the parent hard-wires EagleDraftWorker,
    so the attributes its methods read are set here)."""

    def __init__(self, server_args: ServerArgs, gpu_id: int, nccl_port: int, target_worker: TpModelWorker):
        BaseSpecWorker.__init__(self)
        self.server_args = server_args
        self.topk = get_spec().speculative_eagle_topk
        self.speculative_num_steps = get_spec().speculative_num_steps
        self.speculative_num_draft_tokens = get_spec().speculative_num_draft_tokens
        self.gpu_id = gpu_id
        self.device = get_device().device
        self._target_worker = target_worker
        self.page_size = get_schedule().page_size
        self.speculative_algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
        self.enable_dp_spec_prefill_coordination = False
        self._hosts_draft = True  # pp_size 1 (checked at startup)
        self._draft_worker = MoADraftWorker(server_args, gpu_id, nccl_port, target_worker)
        self.adaptive_controller = None
        self.num_new_pages_per_topk = torch.empty((), dtype=torch.int64, device=self.device)
        self.extend_lens = torch.empty((), dtype=torch.int64, device=self.device)
        self.plan_stream, self.plan_stream_ctx = get_plan_stream(self.device)

    @property
    def last_shared_read_runner(self):
        # the MoA commit reads the target pool outside any runner forward: the target runner's
        # read-done event is the last one recorded
        return self._target_worker.model_runner

    @property
    def spec_v2_attn_backends(self) -> tuple:
        return (self._target_worker.model_runner.attn_backend,)


__all__ = ["MoADraftWorker", "MoAWorkerV2", "sglang_tli_layer"]
