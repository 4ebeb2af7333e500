"""moa-serve's out-of-tree SGLang plugin (entry-point group `sglang.srt.plugins`, name `moa_serve`).

SGLang's `load_plugins()` runs `register()` in every SGLang process (launcher, scheduler,
detokenizer) before server args are parsed, so after `pip install` of this package:

    python -m sglang.launch_server --model-path T --speculative-algorithm MOA \
        --speculative-draft-model-path drafters/smollm2-moa-tli1 ...

What `register()` does (no SGLang file is patched, no hook is needed):
    1. transformers AutoConfig learns model_type "moa_draft"        (hf_config.py)
    2. SpeculativeAlgorithm "MOA" with its checks and worker factory   (algorithm.py)
    3. ModelRegistry learns architecture "MoADraftModel"               (models/moa_draft.py)

Modules: layout.py (pure index/tree functions), draft_core.py (the MoA draft core of
drafters/moa_core.py over SGLang's slot pools), tree_attention.py (backend choice for the draft
passes), worker.py (MoAWorkerV2 / MoADraftWorker on SGLang's EAGLE v2 worker schema).
"""

from __future__ import annotations

MODELS_PACKAGE = "sglang_ext.sglang_plugin.models"


def register() -> None:
    from .algorithm import register_algorithm
    from .hf_config import register_hf_config

    register_hf_config()
    register_algorithm()
    register_models()


def register_models() -> None:
    from sglang.srt.models.registry import ModelRegistry

    from ..models.checkpoint import MOA_ARCH

    if MOA_ARCH not in ModelRegistry.models:
        ModelRegistry.register(MODELS_PACKAGE)
