import os
import sys
from pathlib import Path

import pytest
import torch

from sglang_ext.settings import settings

sys.path.insert(0, str(Path(__file__).parent))
# torch threads: the cores shared among the pytest-xdist workers (`make test` runs one per core), at most 2;
# MOA_TEST_THREADS=1 while a background job (e.g. training) holds a core: oversubscribed OpenMP is much slower
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("MOA_TEST_THREADS", max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))))


@pytest.fixture(autouse=True)
def _settings_per_test():
    """settings() reads MOA_* once per process: a test that changes them calls reload_settings(), and each
    test ends by dropping the cached Settings (after monkeypatch restored the environment)."""
    yield
    settings.cache_clear()


@pytest.fixture(scope="session")
def smollm2_fp32():
    from sglang_ext.models import load_target

    return load_target("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def eval_prompts(smollm2_fp32):
    """>= 20 chat prompts drawn from several eval categories (built-in set when ../shared is absent)."""
    from sglang_ext.evalsets import EVAL_SETS, eval_dir, load_eval_set

    texts = []
    if eval_dir() is not None:
        for name in EVAL_SETS:
            texts += load_eval_set(name, 4)[1]
    else:
        texts = load_eval_set("builtin")[1] * 3
    return [smollm2_fp32.encode_chat([{"role": "user", "content": t[:600]}]) for t in texts[:24]]
