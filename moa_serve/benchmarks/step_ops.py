"""A CPU proxy for a drafted step's host cost on a GPU: the torch ops one steady-state engine step
dispatches outside graph replays.

    python -m moa_serve.benchmarks.step_ops [--drafters eagle3,moa] [--batch 1,4] [--tree 6,4,24] [--layers 4]
                                            [--per-layer] [--where] [--list] [--json]

On a GPU a small step is host-bound: every op dispatched outside a CUDA graph costs the host a few
microseconds (a launch when it computes on the device, a queued copy when it moves host data up, pure
host work otherwise), while a graph replay costs one launch whatever it holds. Off a GPU the same code
runs; here the target and the drafter live on the meta device (it stands for the GPU: shapes only, no
values, no compute), the runners take their static paths eagerly (what a GPU captures and replays), and
a dispatch mode counts every op per step, split into

    graph    ops of a runner's captured function (GraphCache.run's fn): one replay each on a GPU
    device   other ops computing on the device: one kernel launch each on a GPU
    view     other view ops (no launch, still host dispatch)
    upload   host -> device copies
    host     ops on host tensors (slot ids, positions, masks built on the host)

Beside them, `kernels`: the launches the step's graphs make on a GPU. The target takes its GPU layer path
(the Triton layer ops, the static attention's Triton kernel) on the meta device while counting
(kernels.gpu_stand_in); each Triton launch is counted instead of run, and each aten op inside a graph
that computes (no view, no allocation: NO_LAUNCH) counts one launch (a cuBLAS GEMM, an elementwise
kernel). Triton launches outside graphs count as `device` ops. `--per-layer` adds what one decoder
layer costs: the kernels at 2 x --layers minus those at --layers, divided by --layers. `--where` counts the
ops outside graphs by the project function that issued them; `--list` lists the last step's, op by op, with
their kind and file:function:line.

The step's one device-to-host copy (verify.to_host; a plain decode step's verify.tokens_to_host) is stood in
for (meta tensors hold no values): it accepts each drafted tree's first draft and a bonus token, so the
drafter's commit runs as in serving.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import Counter
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KINDS = ("graph", "device", "view", "upload", "host")
# aten ops that launch no kernel: allocations (free inside a CUDA graph: its memory pool) and metadata
NO_LAUNCH = frozenset(
    "empty empty_like empty_strided new_empty new_empty_strided _unsafe_view detach alias lift_fresh".split()
)


class StepOps(TorchDispatchMode):
    """Counts dispatched ops by kind (see the module docstring) and, outside graphs, by op name."""

    def __init__(self, where: bool = False, listing: bool = False):
        """where: also count the ops outside graphs by the innermost project function that issued them;
        listing: also list every op outside graphs in order, as (kind, op, file:function:line)."""
        super().__init__()
        self.kinds: Counter = Counter()
        self.names: Counter = Counter()
        self.sites: Counter = Counter()
        self.where = where
        self.listing: list[tuple[str, str, str]] | None = [] if listing else None
        self.in_graph = 0
        self.kernels = 0  # launches inside graphs: aten ops that compute (no view, no allocation), Triton kernels
        self.kernel_names: Counter = Counter()

    def triton_launch(self, name: str) -> None:
        """A Triton kernel launched (counted by counting_triton, never run: meta tensors hold nothing)."""
        if self.in_graph:
            self.kinds["graph"] += 1
            self.kernels += 1
            self.kernel_names[name] += 1
        else:
            self.kinds["device"] += 1
            self.names[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if self.in_graph:
            self.kinds["graph"] += 1
            if not func.is_view and name not in NO_LAUNCH:
                self.kernels += 1
                self.kernel_names[name] += 1
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type != "cpu"]
        on_host = [t for t in tensors if t.device.type == "cpu"]
        if on_device and on_host and name in ("_to_copy", "copy_"):
            kind = "upload"
        elif func.is_view:
            kind = "view"
        elif on_device:
            kind = "device"
        else:
            kind = "host"
        self.kinds[kind] += 1
        if kind != "view":
            self.names[name] += 1
        if self.where:
            self.sites[_site()] += 1
        if self.listing is not None:
            self.listing.append((kind, name, _site(line=True)))
        return out


def _site(line: bool = False) -> str:
    """file:function (line: file:function:line) of the innermost frame in sglang_ext/ or serving/."""
    import traceback

    for f in reversed(traceback.extract_stack()):
        if "/sglang_ext/" in f.filename or "/serving/" in f.filename:
            return f"{f.filename.split('/')[-1]}:{f.name}" + (f":{f.lineno}" if line else "")
    return "?"


@contextlib.contextmanager
def counting_graphs(mode: StepOps):
    """GraphCache.run's captured function counts as 'graph' while it runs."""
    from sglang_ext.models import graph_runner

    real = graph_runner.GraphCache.run

    def run(self, key, make_buffers, fill, fn):
        def marked(bufs):
            mode.in_graph += 1
            try:
                return fn(bufs)
            finally:
                mode.in_graph -= 1

        return real(self, key, make_buffers, fill, marked)

    graph_runner.GraphCache.run = run
    try:
        yield
    finally:
        graph_runner.GraphCache.run = real


@contextlib.contextmanager
def counting_triton(mode: StepOps):
    """Triton launches counted in `mode` instead of run, while meta tensors take the GPU's kernel paths
    (kernels.gpu_stand_in): what a CUDA step launches, counted without a GPU."""
    from triton.runtime.jit import JITFunction

    from sglang_ext import kernels

    real = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if warmup or not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        mode.triton_launch(self.fn.__name__)
        return None

    JITFunction.run = run
    try:
        with kernels.gpu_stand_in("meta"):
            yield
    finally:
        JITFunction.run = real


def _stand_in_copy(paths):
    """verify.to_host for meta tensors: each drafted tree's first draft node accepted, then a bonus."""
    from sglang_ext.verify import VerifyResult

    return [VerifyResult([0, 1], [5, 11]) if p.nodes.numel() > 1 else VerifyResult([0], [11]) for p in paths]


def _drafter(kind: str, model, cfg):
    from sglang_ext.drafters.eagle3 import Eagle3Drafter
    from sglang_ext.drafters.moa import MoADrafter
    from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft
    from sglang_ext.models.moa import MoAConfig, MoADraft

    if kind == "eagle3":
        return Eagle3Drafter(model, Eagle3Draft(Eagle3Config.for_target(cfg, 2048)), num_slots=4096)
    if kind == "moa":
        return MoADrafter(model, MoADraft(MoAConfig.for_target(cfg, tli=1, draft_vocab_size=2048)), num_slots=4096)
    raise ValueError(f"unknown drafter {kind!r}")


def count_step_ops(
    kind: str | None,
    batch: int,
    tree: str = "6,4,24",
    layers: int = 4,
    steps: int = 3,
    where: bool = False,
    listing: bool = False,
) -> dict:
    """Ops per steady-state engine step (the mean over `steps` steps after the prefill and two warm steps) of `batch`
    requests decoding with drafter `kind` (None: vanilla) at SmolLM2's widths with `layers` layers; listing: also
    every op outside graphs of the last step, in order (`listing`: [kind, op, file:function:line])."""
    import serving.decode_step as decode_mod
    import serving.engine as engine_mod
    from serving.config import EngineConfig
    from serving.engine import Engine
    from sglang_ext.attention import tree_attention_torch
    from sglang_ext.models import Target
    from sglang_ext.models.graph_runner import GraphRunner
    from sglang_ext.models.synthetic import random_target, smollm2_config
    from sglang_ext.sampling import SamplingParams
    from sglang_ext.tree import TreeShape

    cfg = replace(smollm2_config(), num_layers=layers)
    model = random_target(cfg, "meta")
    model.attention = tree_attention_torch
    # the GPU's layer path (Triton layer ops) while counting: its launches are counted, not run
    model.gpu_layer_ops = True
    drafter = _drafter(kind, model, cfg) if kind else None
    shape = TreeShape.parse(tree)
    config = EngineConfig(kv_slots=8192, tree=shape, adaptive=False, cuda_graphs=False, prefix_cache=False)
    real_copy, real_tokens = engine_mod.to_host, decode_mod.tokens_to_host
    engine_mod.to_host = _stand_in_copy
    decode_mod.tokens_to_host = lambda tokens: [11] * tokens.numel()  # (a plain decode step's copy)
    try:
        eng = Engine(Target(model, None, None), drafter, config)
        # the runners' static paths, run eagerly (a GPU captures and replays them)
        eng.runner.graph_runner = GraphRunner(eng.model, eng.capture_layers, graphs=False)
        if drafter is not None:
            drafter.step_graphs = True
        params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
        for i in range(batch):
            eng.add_request(list(range(10 + i, 40 + i)), params)
        while eng.waiting:  # prefill (in chunks of the engine's prefill budget)
            eng.step()
        for _ in range(2):  # two steps: every bucket's buffers made
            eng.step()
        mode = StepOps(where)
        with counting_graphs(mode), counting_triton(mode), mode:
            for _ in range(steps - 1 if listing else steps):
                eng.step()
        if listing:  # the last step alone, listed op by op
            last = StepOps(where, listing=True)
            with counting_graphs(last), counting_triton(last), last:
                eng.step()
            _merge(mode, last)
        if drafter is not None and not all(r.drafting for r in eng.running):  # (a drafter fault: vanilla steps)
            raise RuntimeError(f"{kind}: a request fell back to vanilla decoding; the counts are not a drafted step's")
    finally:
        engine_mod.to_host, decode_mod.tokens_to_host = real_copy, real_tokens
    per_step = {k: mode.kinds[k] / steps for k in KINDS}
    per_step["outside"] = sum(v for k, v in per_step.items() if k != "graph")
    per_step["kernels"] = mode.kernels / steps
    ops = {n: c / steps for n, c in mode.names.most_common()}  # outside graphs, views aside
    top = dict(list(ops.items())[:15])
    sites = {n: c / steps for n, c in mode.sites.most_common(25)}
    return {
        "drafter": kind or "vanilla",
        "batch": batch,
        "tree": tree,
        "per_step": per_step,
        "top_ops": top,
        "kernel_ops": {n: c / steps for n, c in mode.kernel_names.most_common()},
        "ops": ops,
        "sites": sites,
        **({"listing": last.listing} if listing else {}),
    }


def _merge(into: StepOps, other: StepOps) -> None:
    """Adds other's counts to into's."""
    for a, b in ((into.kinds, other.kinds), (into.names, other.names), (into.sites, other.sites)):
        a.update(b)
    into.kernel_names.update(other.kernel_names)
    into.kernels += other.kernels


def kernels_per_layer(kind: str | None, batch: int, tree: str = "6,4,24", layers: int = 4) -> float:
    """The launches one decoder layer adds to a step's graphs: (kernels at 2 x layers - at layers) / layers."""
    k = [count_step_ops(kind, batch, tree, n, steps=1)["per_step"]["kernels"] for n in (layers, 2 * layers)]
    return (k[1] - k[0]) / layers


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", default="vanilla,eagle3,moa")
    p.add_argument("--batch", default="1,4")
    p.add_argument("--tree", default="6,4,24")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--where", action="store_true", help="also list the functions issuing the ops outside graphs")
    p.add_argument("--list", action="store_true", help="also list every op outside graphs of one step, in order")
    p.add_argument("--per-layer", action="store_true", help="also the kernels one decoder layer adds (2 more runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    a = p.parse_args(argv)
    for kind in a.drafters.split(","):
        for bs in (int(x) for x in a.batch.split(",")):
            r = count_step_ops(None if kind == "vanilla" else kind, bs, a.tree, a.layers, where=a.where, listing=a.list)
            if a.per_layer:
                r["kernels_per_layer"] = kernels_per_layer(None if kind == "vanilla" else kind, bs, a.tree, a.layers)
            if a.json:
                print(json.dumps(r))
                continue
            s = r["per_step"]
            cols = " ".join(f"{k} {s[k]:6.1f}" for k in (*KINDS, "outside", "kernels"))
            per_layer = f" ({r['kernels_per_layer']:g} a layer)" if a.per_layer else ""
            print(f"{r['drafter']:8s} bs {bs}: {cols}{per_layer}")
            print("    top outside:", ", ".join(f"{n} {c:g}" for n, c in r["top_ops"].items()))
            if a.where:
                print("    where:", ", ".join(f"{n} {c:g}" for n, c in r["sites"].items()))
            for kind_, op, site in r.get("listing", []):
                print(f"    {kind_:6s} {op:24s} {site}")


if __name__ == "__main__":
    main()
