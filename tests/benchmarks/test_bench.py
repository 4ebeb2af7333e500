"""The benchmark harness itself: tau arithmetic, same-run speedups, failed methods reported."""

import json

from moa_serve.benchmarks.bench import MethodResult, markdown_table
from moa_serve.entrypoints.cli import main
from sglang_ext.tree import TreeShape


def test_tau_from_known_accepts():
    r = MethodResult("x", "s", "-", verify_steps=3, accepted=2 + 0 + 3, drafted=15, tokens=8, seconds=2.0)
    assert r.tau == (3 + 1 + 4) / 3 and r.draft_per_step == 5 and r.tokens_per_s == 4


def test_speedup_uses_same_run_vanilla_and_failures_are_rows():
    rows = [
        MethodResult("vanilla", "a", "-", tokens=10, seconds=1.0, verify_steps=10, prompts=1),
        MethodResult("ngram", "a", "4,1,5", tokens=10, seconds=0.5, verify_steps=5, accepted=5, prompts=1, identical=1),
        MethodResult("vanilla", "b", "-", tokens=10, seconds=2.0, verify_steps=10, prompts=1),
        MethodResult("ngram", "b", "4,1,5", tokens=10, seconds=0.5, verify_steps=5, accepted=5, prompts=1),
        MethodResult("eagle3", "b", "6,4,24", error="FileNotFoundError: no checkpoint"),
    ]
    table = markdown_table(rows)
    assert "| a | ngram | 4,1,5 | 2.00 | 0.0 | 20.0 | 2.00× | 1/1 |" in table
    assert "4.00×" in table  # set b's own vanilla (5 tok/s), not set a's
    assert "failed: FileNotFoundError" in table


def test_bench_quick_end_to_end(tmp_path):
    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "--quick",
            "--eval-sets",
            "builtin",
            "--peers",
            "none",
            "--methods",
            "ngram;nope",
            "--dtype",
            "float32",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    by = {r["method"]: r for r in data["results"]}
    assert by["vanilla"]["tokens"] > 0 and by["ngram"]["verify_steps"] > 0 and by["ngram"]["identical"] == 2
    assert "unknown drafter" in by["nope"]["error"]
    assert "| builtin | ngram |" in (out / "table.md").read_text()


# --- batch sweep and gateway overhead -------------------------------------------------------------

from moa_serve.benchmarks.batch import (  # noqa: E402
    BatchResult,
    BatchRun,
    batch_grid_table,
    batch_rows_table,
    run_batch_sweep,
    speedup,
)


def test_batch_speedup_is_against_same_batch_size_vanilla():
    rows = [
        BatchResult("vanilla", "-", 1, tokens=10, seconds=1.0, runs=1),
        BatchResult("ngram", "6,2,12", 1, True, tokens=20, seconds=1.0, runs=1, verify_steps=10, accepted=10),
        BatchResult("vanilla", "-", 2, tokens=40, seconds=1.0, runs=1),
        BatchResult("ngram", "6,2,12", 2, True, tokens=40, seconds=2.0, runs=1, verify_steps=10, accepted=10),
    ]
    assert speedup(rows[1], rows) == 2.0 and speedup(rows[3], rows) == 0.5  # not 4.0 from bs=1's vanilla
    grid = batch_grid_table(rows)
    assert "| ngram 6,2,12 adaptive | 20.0 (2.00×) | 20.0 (0.50×) |" in grid
    assert "| 2 | ngram | 6,2,12 | yes | 2.00 |" in batch_rows_table(rows)


def test_speedup_at_full_batch_uses_the_steady_state_rates():
    rows = [
        BatchResult("vanilla", "-", 4, tokens=100, seconds=10.0, runs=1, full_tokens=90, full_seconds=9.0),
        BatchResult("suffix", "5,1,6", 4, True, tokens=100, seconds=12.5, runs=1, full_tokens=90, full_seconds=6.0),
    ]
    assert speedup(rows[1], rows) == 0.8  # the whole run, drain tail included
    assert speedup(rows[1], rows, steady=True) == 1.5  # while 4 requests are in the engine
    assert "| suffix 5,1,6 adaptive | 15.0 (1.50×) |" in batch_grid_table(rows, steady=True)
    assert "| 8.0 | 0.80× | 15.0 | 1.50× |" in batch_rows_table(rows)
    rows[0].full_seconds = 0.0  # no steady-state steps (e.g. a single prompt): n/a, not a crash
    assert speedup(rows[1], rows, steady=True) is None


def test_batch_sweep_failure_at_one_batch_size_is_a_row():
    calls = []

    def make_ok(rate):
        def run(prompts, max_new=4, concurrency=None):
            calls.append(len(prompts))
            return BatchRun(
                tokens=len(prompts) * max_new,
                verify_steps=len(prompts),
                accepted=len(prompts),
                drafted=2 * len(prompts),
            )

        return lambda: run

    def flaky(prompts, max_new=4, concurrency=None):
        if concurrency == 2 and max_new != 1:  # fails at bs=2 only (after its warm-up)
            raise RuntimeError("out of KV slots")
        return BatchRun(tokens=len(prompts) * max_new, verify_steps=len(prompts))

    methods = [
        ("vanilla", "-", False, make_ok(1)),
        ("flaky", "1,1,1", False, lambda: flaky),
        ("broken", "1,1,1", False, lambda: (_ for _ in ()).throw(ValueError("no checkpoint"))),
    ]
    res = run_batch_sweep(methods, [[1, 2, 3]], [1, 2, 4], warmup_tokens=1, measure_memory=False)
    by = {(r.method, r.batch_size): r for r in res}
    assert len(res) == 9  # every method has a row at every batch size
    assert (
        by[("flaky", 1)].error is None and by[("flaky", 4)].error is None and by[("flaky", 1)].tokens == 2 * 4
    )  # 2 prompts at bs 1
    assert "out of KV slots" in by[("flaky", 2)].error
    assert all("no checkpoint" in by[("broken", b)].error for b in (1, 2, 4))
    assert by[("vanilla", 4)].tau == 2.0 and by[("vanilla", 4)].draft_per_step == 2.0
    assert "| 2 | flaky | 1,1,1 | no | failed: RuntimeError: out of KV slots |" in batch_rows_table(res)
    assert "| flaky 1,1,1 | " in batch_grid_table(res) and "| failed |" in batch_grid_table(res)


def test_sweep_serves_a_prompt_queue_b_at_a_time():
    from moa_serve.benchmarks.batch import sweep_prompts

    prompts = [[i] for i in range(5)]
    assert sweep_prompts(prompts, 1, 3) == [[0], [1], [2]]
    assert sweep_prompts(prompts, 2, 3) == [[0], [1], [2], [3]]  # 2 rounds of the batch size
    assert sweep_prompts(prompts, 4, 3) == [[0], [1], [2], [3], [4], [0], [1], [2]]  # cycled
    calls = []

    def run(queue, max_new=4, concurrency=None):
        calls.append((len(queue), concurrency))
        return BatchRun(tokens=len(queue) * max_new, verify_steps=len(queue))

    (row,) = run_batch_sweep(
        [("vanilla", "-", False, lambda: run)], prompts, [1], warmup=False, measure_memory=False, min_prompts=3
    )
    assert calls == [(3, 1)] and row.tokens == 12 and row.runs == 1


def test_sweep_interleaves_stepped_runners_step_by_step():
    """Runners with a step generator take turns one step at a time (machine drift hits all alike);
    each row still gets its own time, and one failing mid-run does not stop the others."""
    order = []

    def stepped(name, n, fail_at=None):
        def steps(queue, max_new=4, concurrency=None):
            res = BatchRun(0, seconds=0.0)
            for k in range(n):
                if k == fail_at:
                    raise RuntimeError("drafter exploded")
                order.append(name)
                res.seconds += 0.5
                res.tokens += 1
                yield
            return res

        def run(queue, max_new=4, concurrency=None):
            from moa_serve.benchmarks.batch import drive

            return drive(steps(queue, max_new, concurrency))

        run.steps = steps
        return lambda: run

    methods = [
        ("vanilla", "-", False, stepped("v", 3)),
        ("fast", "1,1,1", False, stepped("f", 2)),
        ("bad", "1,1,1", False, stepped("x", 3, fail_at=1)),
    ]
    res = run_batch_sweep(methods, [[1]], [1], warmup=False, measure_memory=False)
    assert order == ["v", "f", "x", "v", "f", "v"]
    by = {r.method: r for r in res}
    assert by["vanilla"].seconds == 1.5 and by["fast"].seconds == 1.0  # own steps only, not the others'
    assert by["fast"].tokens == 2 and "drafter exploded" in by["bad"].error


def test_engine_runner_keeps_b_requests_running(smollm2_fp32):
    """Continuous batching in the sweep: never more than b running, refilled until the queue is served."""
    from moa_serve.benchmarks.batch import engine_batch_runner

    prompts = [smollm2_fp32.encode_chat([{"role": "user", "content": f"Count to {n}."}]) for n in range(5)]
    run = engine_batch_runner(smollm2_fp32, "vanilla", TreeShape.chain(1), 6, False, {})
    res = run(prompts, 6, concurrency=2)
    assert len(res.outputs) == 5 and all(len(o) <= 6 for o in res.outputs)
    assert 1.0 <= res.batch_sum / res.decode_steps <= 2.0  # mean running batch never above b
    # steady state = steps with 2 requests in the engine: the 5th prompt's steps alone are the tail
    assert 0 < res.full_tokens < res.tokens and 0 < res.full_seconds
    alone = run(prompts[:1], 6)
    assert alone.outputs[0] == res.outputs[0]  # batching does not change outputs (greedy, fp32)
    # stepped (as an interleaved sweep runs it): the same outputs, its own time counted
    from moa_serve.benchmarks.batch import interleave

    spec = engine_batch_runner(smollm2_fp32, "ngram", TreeShape(3, 1, 4), 6, True, {})
    a, b = interleave([run.steps(prompts, 6, 2), spec.steps(prompts, 6, 2)])
    assert a.outputs == res.outputs == b.outputs and 0 < a.seconds and 0 < b.seconds
    # the sweep releases the engine after each batch size; the adaptive policy must outlive it (a new
    # batch size starts from what was measured at its neighbour instead of exploring from scratch)
    policy = spec.policy()
    spec.release()
    spec(prompts[:4], 6, concurrency=4)
    assert spec.policy() is policy and {"2", "4"} <= {b for _, b in policy.stats}


def test_bench_batch_sweep_and_gateway_overhead_quick(tmp_path):
    out = tmp_path / "sweep"
    rc = main(
        [
            "bench",
            "--quick",
            "--sweep-only",
            "--eval-sets",
            "builtin",
            "--methods",
            "ngram;nope",
            "--dtype",
            "float32",
            "--batch-sizes",
            "1,2",
            "--max-new-tokens",
            "6",
            "--adaptive",
            "--gateway-overhead",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["batch_sweep"]["rows"]
    by = {(r["method"], r["batch_size"]): r for r in rows}
    assert set(by) == {(m, b) for m in ("vanilla", "ngram", "nope") for b in (1, 2)}
    for b in (1, 2):
        v, n = by[("vanilla", b)], by[("ngram", b)]
        assert v["tokens"] > 0 and n["verify_steps"] > 0 and n["adaptive"] and not v["adaptive"]
        assert abs(n["speedup_vs_vanilla"] - n["tokens_per_s"] / v["tokens_per_s"]) < 1e-9  # same-bs vanilla
        assert (
            n["decode_tokens_per_s"] > 0 and n["decode_tokens"] == n["tokens"] - 2 * b
        )  # 2b prompts served; first tokens come from prefill
        assert n["peak_rss_mb"] > 0 and "unknown drafter" in by[("nope", b)]["error"]
    assert by[("vanilla", 2)]["mean_batch"] > 1
    (oh,) = data["gateway_overhead"]
    assert oh["error"] is None and oh["engine_p50_ms"] > 0 and oh["http_p50_ms"] > 0 and oh["same_tokens"] is True
    table = (out / "table.md").read_text()
    assert (
        "## Throughput vs batch size" in table
        and "| method | bs=1 | bs=2 |" in table
        and "## Gateway overhead" in table
    )
    assert (out / "throughput_vs_batch.png").stat().st_size > 1000


def test_tau_per_eval_set_plot(tmp_path):
    from moa_serve.benchmarks.bench import MethodResult, plot_tau_by_set

    rows = [
        MethodResult("vanilla", "mt_bench", "-", tokens=10, seconds=1.0),
        MethodResult("moa", "mt_bench", "5,4,16", tokens=10, seconds=1.0, verify_steps=4, accepted=4),
        MethodResult("moa", "gsm8k", "5,4,16", tokens=10, seconds=1.0, verify_steps=5, accepted=10),
        MethodResult("eagle3", "gsm8k", "5,4,16", error="boom"),
    ]
    assert rows[1].tau == 2.0 and rows[2].tau == 3.0
    assert plot_tau_by_set(rows, tmp_path / "tau.png") and (tmp_path / "tau.png").stat().st_size > 1000
    assert not plot_tau_by_set(rows[:1], tmp_path / "none.png")


def test_bench_turns_online_learning_off_inside_a_merged_drafter(smollm2_fp32):
    from moa_serve.benchmarks.bench import bench_drafter

    drafter = bench_drafter("suffix+ngram", smollm2_fp32)
    assert drafter.name == "suffix+ngram" and drafter.members[0].online is False
