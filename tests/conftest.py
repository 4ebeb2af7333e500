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
# ...and they stay the harness's: a command run in-process (`moa-serve distill` sets --threads 2, a training job
# its config's threads) would set two threads on a worker beside the other worker, oversubscribing the cores
# for that test and every later one on the worker. (--threads itself is exercised by the subprocess tests.)
torch.set_num_threads = lambda n: None
# the processes tests start (servers, CLIs, torchrun's ranks, interpreted kernels) get one OpenMP thread: beside
# the workers, which use every core, a default-sized pool in each of them oversubscribes the cores
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


# the longest test files, longest first (per-file time of a full run): under pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`, as `make test` runs it) a file runs whole on one worker and the workers take files in
# collection order, so these start first and the short files fill in around them instead of one long file
# running alone at the end
LONGEST_FIRST = (
    "serving/test_engine.py",
    "serving/test_engine_prefix_cache.py",
    "sglang_ext/test_merged.py",
    "serving/test_gateway.py",
    "deploy/test_image_replay.py",
    "sglang_ext/test_distribution.py",
    "sglang_ext/test_moa.py",
    "serving/test_hostile.py",
    "benchmarks/test_gpu_job.py",
    "packaging/test_wheel.py",
    "sglang_ext/test_attention.py",
    "sglang_ext/test_lookahead.py",
    "sglang_ext/test_medusa.py",
    "sglang_ext/test_graph_runner.py",
    "deploy/test_live_loadtest.py",
    "sglang_ext/test_sglang_parity.py",
    "entrypoints/test_distill_remote.py",
    "sglang_ext/test_packed_weights.py",
    "sglang_ext/test_targets.py",
    "entrypoints/test_train.py",
    "sglang_ext/test_training_device.py",
    "benchmarks/test_bench.py",
    "serving/test_engine_device.py",
    "serving/test_grammar_pool.py",
)


def pytest_collection_modifyitems(session, config, items):
    """LONGEST_FIRST's files first (the sort is stable: a file's tests stay together and in order)."""
    tests = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        try:
            return rank.get(item.path.relative_to(tests).as_posix(), len(rank))
        except ValueError:
            return len(rank)

    items.sort(key=key)


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
def smollm2_cuda():
    """The shipped target in bf16 on a CUDA device (tests that use it skip without one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from sglang_ext.models import load_target

    return load_target("smollm2", dtype="bfloat16", device="cuda")


@pytest.fixture(scope="session")
def smollm2_q8():
    """The shipped target at the q8 dtype (tests that use it skip where q8 cannot run)."""
    from sglang_ext.models import load_target

    return load_target("smollm2", dtype="q8")


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
