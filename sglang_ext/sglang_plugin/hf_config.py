"""A transformers config class for MoA checkpoints, so SGLang's config loader can read them.

SGLang reads a draft's config.json through `AutoConfig`, which only knows registered model types.
Our checkpoints say `model_type: "moa_draft"`; registering this class makes `AutoConfig` (and
SGLang's `ModelConfig`) accept them. The standard names SGLang reads are mapped onto ours:

    num_attention_heads  -> num_heads      (SA/CA heads)
    num_key_value_heads  -> num_kv_heads   (SA/CA KV heads: the draft KV pool's head count)
    max_position_embeddings -> max_position
    num_hidden_layers = 2                  the draft KV pool's layers: 0 = SA K/V, 1 = CA K/V

`moa_config()` gives back the checkpoint's `MoAConfig` (the single source of truth).
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from ..models.checkpoint import MOA_ARCH
from ..models.moa import MoAConfig

MODEL_TYPE = "moa_draft"
DRAFT_KV_LAYERS = 2  # pool layer 0: SA keys/values of verified tokens; 1: CA keys/values (LSA memory)
SA_KV_LAYER, CA_KV_LAYER = 0, 1


class MoADraftHFConfig(PretrainedConfig):
    model_type = MODEL_TYPE
    attribute_map = {
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
        "max_position_embeddings": "max_position",
    }

    def __init__(
        self, num_heads: int = 8, num_kv_heads: int = 4, head_dim: int = 64, max_position: int = 8192, **kwargs
    ):
        kwargs.pop("num_hidden_layers", None)  # always the draft pool's two layers
        kwargs.setdefault("architectures", [MOA_ARCH])
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_position = max_position
        self.num_hidden_layers = DRAFT_KV_LAYERS

    def moa_config(self) -> MoAConfig:
        d = self.to_dict()
        d.pop("num_hidden_layers", None)
        return MoAConfig.from_json(d)


def register_hf_config() -> None:
    """Idempotent: AutoConfig refuses a second registration of the same model type."""
    try:
        AutoConfig.register(MODEL_TYPE, MoADraftHFConfig)
    except ValueError as e:
        if "already" not in str(e).lower():
            raise
