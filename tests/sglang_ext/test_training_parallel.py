"""Data parallel training on real torch.distributed (gloo, two processes): two ranks on the halves of each
global batch train exactly as one rank on the whole batch (every step's metrics and the heads' weights
after the steps), for EAGLE-3 and MoA; a global batch of fewer rows than ranks adds nothing on the rank
without rows; and a run stopped at a checkpoint and resumed ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from helpers import tiny_config, tiny_state

from sglang_ext.models import LlamaModel
from sglang_ext.training import job as job_mod
from sglang_ext.training import parallel
from sglang_ext.training.data import Batch, Example, Part, make_batches
from sglang_ext.training.target import TargetRunner
from sglang_ext.training.trainer import OptimConfig, RunConfig, Trainer

HEADS = ("eagle3", "moa-tli0", "moa-tli1")
STEPS = 6


def _examples(n=10, vocab=64, seed=0) -> list[Example]:
    """Repetitive sequences of varied lengths (learnable, so the heads move), a prompt of 3 tokens each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(8, 56, (5 + i % 3,), generator=g)
        ids = base.repeat(4)[: 14 + 2 * (i % 4)]
        out.append(Example(ids, torch.arange(ids.numel()) >= 3))
    return out


def _trainer(out_dir, world: parallel.World, steps: int = STEPS, heads=HEADS, batches=None) -> Trainer:
    cfg = tiny_config(vocab=64, layers=4)
    target = LlamaModel(cfg, tiny_state(cfg, 0))
    moa = {"lambda_kl": 1.0, "lambda_feat": 0.1, "min_gap": 3, "max_gap": 5}
    tasks = job_mod.build_tasks(target, torch.arange(8, 56), heads, moa, seed=0)
    for t in tasks:
        t.autocast = False
    batches = batches or make_batches(_examples(), 90, seed=0)
    run = RunConfig(str(out_dir), steps, save_every_s=1e9, progress_bar=False)
    return Trainer(tasks, TargetRunner(target, 256), batches, OptimConfig(lr=3e-3, warmup_ratio=0.2), run, world=world)


def _train(trainer: Trainer, steps: int) -> list[dict[str, float]]:
    rows = []
    for _ in range(steps):
        rows.append({k: float(v) for k, v in trainer.train_step(trainer.batch_at(trainer.step)).items()})
        trainer.step += 1
    return rows


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {f"{t.name}.{k}": v.clone() for t in trainer.tasks for k, v in t.module.state_dict().items()}


def _rank(rank: int, size: int, store: str, out: str, batches) -> None:
    torch.set_num_threads(1)
    world = parallel.World(rank, size, rank)
    parallel.start(world, torch.device("cpu"), init_method=f"file://{store}")
    try:
        trainer = _trainer(out, world, batches=batches)
        rows = _train(trainer, STEPS)
        held = [b.lengths.numel() for b in trainer.batches if not b.part.empty]
        torch.save({"rows": rows, "weights": _weights(trainer), "rows_held": held}, f"{out}/rank{rank}.pt")
    finally:
        parallel.stop()


def _two_ranks(tmp_path, batches=None) -> list[dict]:
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), str(tmp_path), batches), nprocs=2, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a - b).norm() / a.norm().clamp(min=1e-12))


def _assert_same_training(one: dict, ranks: list[dict]) -> None:
    for step, (a, b) in enumerate(zip(one["rows"], ranks[0]["rows"])):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-5 * max(abs(a[k]), 1e-6), (step, k, a[k], b[k])
    assert ranks[0]["rows"] == ranks[1]["rows"]  # every rank sees the global batch's metrics
    for k, w in one["weights"].items():
        assert _relative(w, ranks[0]["weights"][k]) <= 1e-5, k
        assert torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]), k  # the ranks never drift apart


def test_part_rows_and_a_rank_past_the_last_row():
    assert Part(0, 2, 5).index == [0, 2, 4] and Part(1, 2, 5).index == [1, 3] and not Part(1, 2, 5).empty
    assert Part(1, 2, 1).index == [0] and Part(1, 2, 1).empty
    ids = torch.arange(12).view(3, 4)
    batch = Batch(ids, torch.ones(3, 4, dtype=torch.bool), torch.tensor([4, 3, 4]))
    assert batch.split(0, 1) is batch
    one = batch.split(1, 2)
    assert one.input_ids.tolist() == [[4, 5, 6, 7]] and one.global_rows == 3 and one.lengths.tolist() == [3]
    assert one.own(torch.arange(3)).tolist() == [1]
    past = Batch(ids[:1], torch.ones(1, 4, dtype=torch.bool), torch.tensor([4])).split(1, 2)
    assert past.input_ids.tolist() == [[0, 1, 2, 3]] and not past.loss_mask.any() and not past.counted().any()


def test_two_gloo_ranks_train_as_one_rank_on_the_same_global_batch(tmp_path):
    """EAGLE-3 and MoA TLI=0/1, 6 steps: the loss and every metric at each step and the heads' weights at the end
    within 1e-5 relative of one rank's."""
    torch.set_num_threads(1)
    single = _trainer(tmp_path / "one", parallel.World())
    one = {"rows": _train(single, STEPS), "weights": _weights(single)}
    ranks = _two_ranks(tmp_path)
    assert sum(ranks[0]["rows_held"]) + sum(ranks[1]["rows_held"]) == sum(b.lengths.numel() for b in single.batches)
    start = _weights(_trainer(tmp_path / "start", parallel.World()))
    assert min(_relative(start[k], w) for k, w in one["weights"].items() if k.endswith("weight")) > 1e-4  # they trained
    _assert_same_training(one, ranks)


def test_a_rank_without_rows_adds_nothing(tmp_path):
    """Global batches of one sequence: rank 1 holds a copy with nothing counted; the result is one rank's."""
    batches = [make_batches([e], 90, seed=0)[0] for e in _examples(4)]
    single = _trainer(tmp_path / "one", parallel.World(), batches=batches)
    one = {"rows": _train(single, STEPS), "weights": _weights(single)}
    _assert_same_training(one, _two_ranks(tmp_path, batches))


def test_a_stopped_run_resumes_bit_identical(tmp_path):
    """Stop at step 3 (its checkpoint), resume in a new trainer, finish: every head's weights, its optimizer
    state and MoA's draws equal an uninterrupted run's exactly."""
    straight = _trainer(tmp_path / "a", parallel.World())
    straight.fit()
    stopped = _trainer(tmp_path / "b", parallel.World())
    stopped.run_cfg = RunConfig(str(tmp_path / "b"), STEPS, save_every_s=1e9, progress_bar=False, stop_step=3)
    stopped.fit()
    resumed = _trainer(tmp_path / "c", parallel.World())
    assert resumed.resume(tmp_path / "b") and resumed.step == 3
    resumed.fit()
    assert resumed.step == straight.step == STEPS and resumed.tokens_seen == straight.tokens_seen
    a, c = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], c[k]) for k in a)
    for oa, oc in zip(straight.opts, resumed.opts):
        for sa, sc in zip(oa.state.values(), oc.state.values()):
            assert all(torch.equal(sa[k], sc[k]) for k in sa)
    assert all(torch.equal(a.gen.get_state(), c.gen.get_state()) for a, c in zip(straight.tasks[1:], resumed.tasks[1:]))
