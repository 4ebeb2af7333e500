"""Training on an accelerator, checked on the CPU: the padded target run equals the pooled one, a
training step's forward of every head is device-clean and sync-free (run on fake CUDA tensors: any CPU
tensor mixed in, any host read of a device value, any data-dependent shape raises), token shards
round-trip, and the GPU job's --smoke mode runs end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import smollm2_config, tiny_config, tiny_state
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from moa_serve.entrypoints.train_job import main as train_job_main
from sglang_ext.models import LlamaModel, synthetic
from sglang_ext.models.checkpoint import INDEX, read_weights, save_weights, weight_files
from sglang_ext.training import job as job_mod
from sglang_ext.training import moa as moa_mod
from sglang_ext.training.data import DataError, Example, make_batches
from sglang_ext.training.shards import distill_examples, load_examples, load_examples_by_source, pack, read_manifest
from sglang_ext.training.target import TargetRunner
from sglang_ext.training.trainer import OptimConfig, RunConfig, Trainer


def _examples(vocab: int, lengths=(20, 17, 25, 9), seed=0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(0, vocab, (n,), generator=g), torch.arange(n) >= 3) for n in lengths]


def test_padded_target_run_matches_the_pooled_one():
    cfg = tiny_config(vocab=64, layers=4)
    target = LlamaModel(cfg, tiny_state(cfg, 0))
    batch = make_batches(_examples(64), 200, 0)[0]
    pooled = TargetRunner(target, 200)
    padded = TargetRunner(target, 200)
    padded.pooled = False
    a, b = pooled.run(batch, (1, 2)), padded.run(batch, (1, 2))
    valid = torch.arange(batch.input_ids.shape[1])[None, :] < batch.lengths[:, None]
    assert torch.allclose(a.hidden[valid], b.hidden[valid], atol=1e-4, rtol=1e-4)
    for layer in (1, 2):
        assert torch.allclose(a.captured[layer][valid], b.captured[layer][valid], atol=1e-4, rtol=1e-4)
    for layer in range(cfg.num_layers):
        (ka, va), (kb, vb) = a.layer_kv(layer), b.layer_kv(layer)
        assert torch.allclose(ka[valid], kb[valid], atol=1e-4, rtol=1e-4) and torch.allclose(
            va[valid], vb[valid], atol=1e-4, rtol=1e-4
        )


def test_a_training_step_of_every_head_is_device_clean_and_sync_free(monkeypatch):
    """SmolLM2's shape on fake CUDA tensors: the batches, the target run and the EAGLE-3 + MoA TLI=0/1
    losses and metrics all stay on the device without a single host read."""
    cfg = smollm2_config()
    batches = make_batches(_examples(cfg.vocab_size, (40, 33, 50)), 256, 0)
    hot = torch.arange(0, 16384, 2)
    drawn_on_host = moa_mod.last_points

    def last_points(*args):  # MoA's verification points come from a CPU generator: host work, not a device read
        with unset_fake_temporarily():
            return drawn_on_host(*args)

    monkeypatch.setattr(moa_mod, "last_points", last_points)
    monkeypatch.setattr(moa_mod, "_to_device", lambda x, device: x.to(device))  # pinned staging needs a CUDA runtime
    with FakeTensorMode(allow_non_fake_inputs=True):
        # NOTE: fp32: autocast needs a real CUDA runtime (bf16 under autocast: the next test, on the CPU)
        target = synthetic.random_target(cfg, "cuda")
        tasks = job_mod.build_tasks(
            target, hot, job_mod.HEADS, {"lambda_kl": 1.0, "lambda_feat": 0.1, "min_gap": 6, "max_gap": 14}
        )
        assert all(t.autocast for t in tasks)
        trainer = Trainer(
            tasks, TargetRunner(target, 256), batches, OptimConfig(), RunConfig("/nonexistent", 10, progress_bar=False)
        )
        assert not trainer.runner.pooled and trainer.batches[0].input_ids.device.type == "cuda"
        batch = trainer.batches[0]
        tout = trainer.runner.run(batch, trainer.capture_layers, keep_kv=trainer.needs_kv)
        # NOTE: the losses, not backward: autograd's engine needs a real CUDA context to start
        for task in tasks:
            loss, metrics = task.loss(batch, tout, 0.5)
            assert loss.device.type == "cuda" and loss.requires_grad
            assert all(v.device.type == "cuda" for v in metrics.values())
            assert all(p.device.type == "cuda" for p in task.module.parameters())
        assert {"acc_6", "loss_6"} <= set(tasks[0].loss(batch, tout, 0.5)[1]) and "kl" in tasks[2].loss(
            batch, tout, 0.5
        )[1]


def test_every_head_trains_in_bf16_under_autocast():
    """What the GPU runs: a bf16 target and bf16 autocast around fp32 heads (here CPU autocast)."""
    cfg = tiny_config(vocab=64, layers=4)
    target = LlamaModel(cfg, tiny_state(cfg, 0), dtype=torch.bfloat16)
    batches = make_batches(_examples(64), 200, 0)
    tasks = job_mod.build_tasks(
        target, torch.arange(8, 56), job_mod.HEADS, {"lambda_kl": 1.0, "lambda_feat": 0.1, "min_gap": 3, "max_gap": 5}
    )
    for t in tasks:
        t.autocast = True
    trainer = Trainer(
        tasks,
        TargetRunner(target, 200),
        batches,
        OptimConfig(lr=3e-3),
        RunConfig("/nonexistent", 12, progress_bar=False),
    )
    steps = []
    for _ in range(12):
        steps.append({k: float(v) for k, v in trainer.train_step(trainer.batches[0]).items()})
        trainer.step += 1
    for head in ("eagle3", "moa-tli0", "moa-tli1"):
        losses = [m[f"{head}/loss"] for m in steps]
        assert np.isfinite(losses).all() and np.mean(losses[-3:]) < 0.9 * losses[0], (head, losses)
        assert all(p.dtype == torch.float32 for p in trainer.tasks[0].module.parameters())


def test_checkpoint_shards_round_trip(tmp_path):
    state = {f"w{i}": torch.full((1024, 256), float(i), dtype=torch.bfloat16) for i in range(5)}  # 512 KiB each
    names = save_weights(state, tmp_path, max_shard_bytes=1200 * 1024)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all((tmp_path / n).stat().st_size <= 1200 * 1024 + 4096 for n in names)
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index["weight_map"]) == set(state) and index["metadata"]["total_size"] == 5 * 512 * 1024
    (tmp_path / "stale.safetensors").write_bytes(b"not read: the index names the files")
    assert [p.name for p in weight_files(tmp_path)] == names
    back = read_weights(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert save_weights({"a": torch.zeros(3)}, tmp_path) == ["model.safetensors"]  # old shards and index removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "stale.safetensors"]


def _distill_dir(tmp_path, vocab=300, n=12, seed=0):
    """Arrays in ../shared/data/distill's format: prompts and the target's answers."""
    rng = np.random.default_rng(seed)
    p_lens, a_lens = rng.integers(5, 30, n), rng.integers(2, 40, n)
    d = tmp_path / "distill"
    d.mkdir()
    np.savez(
        d / "sharegpt-prompts.npz",
        ids=rng.integers(0, vocab, p_lens.sum()).astype(np.uint16),
        offsets=np.concatenate([[0], np.cumsum(p_lens)]),
        src=np.arange(n, dtype=np.int32) * 2,
    )
    np.savez(
        d / "smollm2-sharegpt-answers.npz",
        ids=rng.integers(0, vocab, a_lens.sum()).astype(np.uint16),
        offsets=np.concatenate([[0], np.cumsum(a_lens)]),
        prompt_index=np.arange(n, dtype=np.int32),
    )
    return d, p_lens, a_lens


def test_shards_round_trip_with_masks_and_sources(tmp_path):
    d, p_lens, a_lens = _distill_dir(tmp_path)
    exs = list(distill_examples(d, exclude_records={4}))  # record 4 = prompt 2
    assert len(exs) == 11 and all(e.mask.sum() == len(e.ids) - p for e, p in zip(exs, np.delete(p_lens, 2)))
    other = [type(exs[0])(np.arange(70) % 300, np.arange(70) >= 10)]
    manifest = pack(
        tmp_path / "shards", {"distill:x": iter(exs), "sharegpt": iter(other)}, vocab_size=300, shard_tokens=100
    )
    assert manifest["source_names"] == ["distill:x", "sharegpt"] and len(manifest["shards"]) > 1
    assert manifest["tokens"] == sum(len(e.ids) for e in exs) + 70
    assert manifest["assistant_tokens"] == sum(int(e.mask.sum()) for e in exs) + 60
    by_source = load_examples_by_source(tmp_path / "shards", max_len=1000)
    assert [len(v) for v in by_source.values()] == [11, 1]
    for a, b in zip(exs, by_source["distill:x"]):
        assert np.array_equal(a.ids, b.input_ids.numpy()) and np.array_equal(a.mask, b.loss_mask.numpy())
    windows = load_examples_by_source(tmp_path / "shards", max_len=32)["sharegpt"]
    assert [len(w.input_ids) for w in windows] == [32, 32, 6]  # 70 tokens cut into windows of 32
    assert torch.equal(torch.cat([w.input_ids for w in windows]), torch.arange(70))
    assert len(load_examples(tmp_path / "shards", 1000)) == 12
    with pytest.raises(DataError, match="outside the vocab"):
        pack(tmp_path / "bad", {"x": iter(other)}, vocab_size=50)
    (tmp_path / "shards" / manifest["shards"][0]["file"]).write_bytes(b"corrupt")
    with pytest.raises(DataError, match="checksum"):
        load_examples(tmp_path / "shards", 100)
    with pytest.raises(DataError, match="manifest"):
        read_manifest(tmp_path)


def test_gpu_job_smoke_runs_end_to_end_on_cpu(tmp_path):
    """The GPU job's own --smoke mode: shards -> three heads on one target run -> sharded bf16 heads,
    curves, summary and <= 15 MiB parts that unpack into loadable checkpoints."""
    from sglang_ext.models.eagle3 import load_eagle3
    from sglang_ext.models.moa import load_moa

    d, _, _ = _distill_dir(tmp_path, vocab=49152, n=24)
    pack(tmp_path / "shards", {"distill:d": distill_examples(d)}, vocab_size=49152)
    out = tmp_path / "out"
    assert (
        train_job_main(
            [
                "--shards",
                str(tmp_path / "shards"),
                "--out",
                str(out),
                "--pack",
                str(tmp_path / "parts"),
                "--smoke",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heads"] == list(job_mod.HEADS) and summary["steps"] == 3 and summary["tokens_seen"] > 0
    assert set(summary["held_out"]) == set(job_mod.HEADS) and "acc_0" in summary["held_out"]["eagle3"]
    curves = json.loads((out / "curves.json").read_text())
    assert (
        [len(curves[h]) for h in job_mod.HEADS] == [3, 3, 3]
        and "loss_0" in curves["eagle3"][0]
        and "kl" in curves["moa-tli1"][-1]
    )
    job_mod.unpack_outputs(tmp_path / "parts", tmp_path / "back")
    target = job_mod.smoke_target(49152, torch.device("cpu"))
    e3 = load_eagle3(tmp_path / "back" / "heads" / "eagle3", target.cfg)
    assert (
        e3.cfg.draft_vocab_size == 256
        and json.loads((out / "heads" / "eagle3" / "config.json").read_text())["training"]["step"] == 3
    )
    for tli in (0, 1):
        assert load_moa(tmp_path / "back" / "heads" / f"moa-tli{tli}", target.cfg).cfg.tli == tli
    # fine-tuning: the same job started from those heads keeps their vocab and starts from their weights
    again = [
        "--shards",
        str(tmp_path / "shards"),
        "--out",
        str(tmp_path / "ft"),
        "--smoke",
        "--device",
        "cpu",
        "--heads",
        "eagle3,moa-tli1",
        "--init-from",
        str(tmp_path / "back" / "heads"),
    ]
    assert train_job_main(again) == 0
    ft = load_eagle3(tmp_path / "ft" / "heads" / "eagle3", target.cfg)
    assert torch.equal(ft.d2t, e3.d2t) and not torch.equal(ft.fc.weight, e3.fc.weight)
    assert json.loads((tmp_path / "ft" / "summary.json").read_text())["heads"] == ["eagle3", "moa-tli1"]


def test_the_job_refuses_bad_inputs_in_one_line(tmp_path, capsys):
    """A device that is not there and a head that does not exist: one line and exit 2, before any weights
    are read (a failure while training keeps its traceback)."""
    d, _, _ = _distill_dir(tmp_path, vocab=256, n=4)
    pack(tmp_path / "shards", {"distill:d": distill_examples(d)}, vocab_size=256)
    base = ["--shards", str(tmp_path / "shards"), "--out", str(tmp_path / "out"), "--smoke"]
    if not torch.cuda.is_available():
        assert train_job_main([*base, "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moa-serve train job: error: device 'cuda'") and "\n" not in err
    assert train_job_main([*base, "--device", "cpu", "--heads", "eagle3,hydra"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moa-serve train job: error: unknown head 'hydra'; choose from eagle3")
    assert not (tmp_path / "out").exists()
