"""Shared test helpers: a tiny random Llama (seconds, no files), the numerical-tie rule, and two tenants' clients
with the admission queue's log (the noisy-neighbour tests)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from sglang_ext.device import HostCopy, Stream
from sglang_ext.models import LlamaConfig, LlamaModel, Target
from sglang_ext.models.synthetic import random_state


def tiny_config(vocab=8, hidden=32, layers=3, heads=4, kv_heads=2, bias=False) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position=512,
        tie_word_embeddings=False,
        attention_bias=bias,
        eos_token_ids=(),
    )


def tiny_state(cfg: LlamaConfig, seed=0, std=0.5) -> dict[str, torch.Tensor]:
    """Random weights in HF naming (sglang_ext.models.synthetic); std large enough that next-token distributions
    are peaked: projections N(0, (4 std)^2 / fan_in)."""
    return random_state(cfg, seed, gain=4 * std)


def tiny_target(seed=0, **kw) -> Target:
    cfg = tiny_config(**kw)
    return Target(model=LlamaModel(cfg, tiny_state(cfg, seed)), tokenizer=None, path=None)


def top2_gap(model: LlamaModel, token_ids: list[int]) -> float:
    """Gap between the target's two largest logits after token_ids (full fp32 prefill)."""
    from sglang_ext.attention import causal_mask, plan_attention

    kv = model.new_kv_pool(len(token_ids) + 2)
    s = kv.alloc(len(token_ids))
    out = model.forward(
        torch.tensor(token_ids),
        torch.arange(len(token_ids)),
        s,
        plan_attention([s], [causal_mask(len(token_ids), 0)]),
        kv,
    )
    top = model.logits(out.hidden[-1:])[0].topk(2).values
    return float(top[0] - top[1])


def reference_logprobs(model: LlamaModel, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] log-softmax of one plain causal fp32 forward over prompt + output: row i is
    the distribution output[i] was chosen from."""
    from sglang_ext.attention import causal_mask, plan_attention

    ids = prompt + output[:-1]
    kv = model.new_kv_pool(len(ids) + 1)
    s = kv.alloc(len(ids))
    out = model.forward(
        torch.tensor(ids), torch.arange(len(ids)), s, plan_attention([s], [causal_mask(len(ids), 0)]), kv
    )
    return torch.log_softmax(model.logits(out.hidden)[len(prompt) - 1 :].float(), -1)


def compare_to_reference(
    model: LlamaModel, prompt: list[int], ref: list[int], got: list[int], tol: float = 1e-3
) -> str:
    """'same' | 'tie' (first divergence at a numerical tie of the target) | 'bug'."""
    if ref == got:
        return "same"
    n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if n >= min(len(ref), len(got)):
        return "bug"  # one is a prefix of the other: different lengths without a token divergence
    return "tie" if top2_gap(model, prompt + ref[:n]) < tol else "bug"


def reference_greedy(
    model: LlamaModel, prompt: list[int], params, n: int, grammars=None, stop_ids=()
) -> tuple[list[int], list[float]]:
    """Up to n greedy tokens under params' penalties, min_tokens and grammar (compiled by `grammars`), ending at
    a stop id, with the gap between the two largest allowed logits at each step (ties). Plain decoding with
    none of the engine's machinery: the prompt prefilled once into a KV pool of its own, then one causal fp32
    forward per token."""
    from sglang_ext.attention import causal_mask, plan_attention
    from sglang_ext.grammar import apply_bitmask, tree_bitmask
    from sglang_ext.penalties import output_counts, penalize
    from sglang_ext.tree import chain_tree

    matcher = grammars.matcher(params.grammar) if params.grammar is not None else None
    out: list[int] = []
    gaps: list[float] = []
    kv = model.new_kv_pool(len(prompt) + n + 1)
    slots = kv.alloc(len(prompt))
    plan = plan_attention([slots], [causal_mask(len(prompt), 0)])
    h = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), slots, plan, kv).hidden
    for _ in range(n):
        row = penalize(model.logits(h[-1:]), params, output_counts(out, model.cfg.vocab_size), prompt)
        if len(out) < params.min_tokens:  # no stop before min_tokens
            row[:, sorted(set(stop_ids) | set(params.stop_token_ids))] = float("-inf")
        if matcher is not None:
            row = apply_bitmask(row, tree_bitmask(matcher, chain_tree(0, [], 0), row.shape[-1]))
        top = row[0].topk(2)
        out.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        if matcher is not None:
            assert matcher.accept_token(out[-1])
        if out[-1] in stop_ids or out[-1] in params.stop_token_ids or len(out) == n:
            break
        new = kv.alloc(1)
        slots = torch.cat([slots, new])
        plan = plan_attention([slots], [causal_mask(1, len(slots) - 1)])
        h = model.forward(torch.tensor(out[-1:]), torch.tensor([len(slots) - 1]), new, plan, kv).hidden
    return out, gaps


def smollm2_config():
    """SmolLM2-135M's LlamaConfig (random-weight targets of the real shape)."""
    from sglang_ext.models.synthetic import smollm2_config as config

    return config()


def generate_in_groups(engine, prompts: list[list[int]], bs: int, max_new_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy outputs of `engine` serving `prompts` bs at a time, and the draft tokens it accepted."""
    from sglang_ext.sampling import SamplingParams

    outs, accepted = [], 0
    for i in range(0, len(prompts), bs):
        reqs = engine.generate(prompts[i : i + bs], SamplingParams(max_new_tokens=max_new_tokens))
        outs += [r.output_ids for r in reqs]
        accepted += sum(r.stats.accepted_tokens for r in reqs)
    return outs, accepted


class HostWait(AssertionError):
    """An op that makes a CUDA host wait for the device though it reads no value (see HostWaits)."""


class HostWaits:
    """A dispatch mode (enter it inside FakeTensorMode) that raises HostWait at the ops a CUDA host waits
    on although fake tensors see no read: a host -> device copy that is not queued (non_blocking False:
    CUDA copies from pageable memory and synchronizes), a host index tensor for a device tensor
    (indexing copies it up that way), and a host value written by index_put (`t[idx] = 1` wraps the
    Python scalar in a host tensor and copies it up). Each was a synchronizing call on a real GPU.
    Device means anything but the CPU (fake CUDA, meta). `.raised` keeps every message (the engine turns
    a stage's exception into a request fault, so a test asserts on this list)."""

    INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put")

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class Mode(TorchDispatchMode):
            raised: list[str]

            def wait(self, msg: str):
                import traceback

                ours = [
                    f for f in traceback.extract_stack() if "/sglang_ext/" in f.filename or "/serving/" in f.filename
                ]
                if ours:
                    msg += f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}"
                self.raised.append(msg)
                raise HostWait(msg)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                host = [t for t in tensors if t.device.type == "cpu"]
                device = [t for t in tensors if t.device.type != "cpu"]
                if name in cls.INDEX_OPS and device and host:
                    self.wait(f"{func}: host tensors {[tuple(t.shape) for t in host]} index or fill a device one")
                if name == "_to_copy" and host and str(kwargs.get("device", "cpu")) != "cpu":
                    if not kwargs.get("non_blocking", False):
                        self.wait(f"{func}: a blocking host -> device copy of {tuple(args[0].shape)}")
                if name == "copy_" and args[0].device.type != "cpu" and args[1].device.type == "cpu":
                    if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                        self.wait(f"{func}: a blocking host -> device copy of {tuple(args[1].shape)}")
                return func(*args, **kwargs)

        mode = Mode()
        mode.raised = []
        return mode


def static_runs(drafter) -> int:
    """Runs a drafter's static paths took: its step runner's (one per search step), its search runner's (one per
    whole search) and its extend runner's (one per draft-extend)."""
    runners = (getattr(drafter, n, None) for n in ("_steps", "_search", "_extender"))
    return sum(r.runs for r in runners if r is not None)


def slots_whole(engine) -> bool:
    """No request holds a slot of the engine's target KV pool and none is lost: every slot is free or in the
    prefix cache (engine.slot_accounts)."""
    a = engine.slot_accounts()
    return a.held == 0 and a.detached == 0 and a.lost == 0


def drafter_pools_whole(drafter) -> bool:
    """No request holds a slot of a drafter's own pools: each is free, kept beside the prefix cache
    (drafters/kept.py; members of a merged drafter each) or held by its static search."""
    members = getattr(drafter, "members", None)
    if members is not None:
        return all(drafter_pools_whole(m) for m in members)
    kept = getattr(drafter, "kept", None)
    if kept is None:
        return not getattr(drafter, "reqs", None)
    held = getattr(drafter, "_held", None)  # (a static search's temporary slots, held for good)

    def held_in(p) -> int:
        return held.host.numel() if held is not None and held.host is not None and held.pool is p else 0

    return all(p.num_free + kept.held(i) + held_in(p) == p.num_slots - 1 for i, p in enumerate(kept.pools))


def _chain_with_siblings(chain: int, vocab: int, g: torch.Generator):
    """A verify tree: a chain of `chain` nodes, each with a sibling placed after it (a drafted
    alternative), as ids [N], depth [N], ancestor-or-self mask [N, N] and the chain's rows."""
    parent, on_chain, last = [], [], -1
    for _ in range(chain):
        on_chain.append(len(parent))
        parent.append(last)
        parent.append(last)  # the sibling: same parent, never on the chain
        last = on_chain[-1]
    n = len(parent)
    mask = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for j in range(n):
        i = parent[j]
        while i >= 0:
            mask[j, i] = True
            depth[j] += 1
            i = parent[i]
    return torch.randint(3, vocab, (n,), generator=g), depth, mask, on_chain


def tree_rows_against_decodes(model, path: str, n_prompt: int = 300, chain: int = 8) -> list[tuple]:
    """Per chain position of a verify tree, where its row first differs from decoding its token alone
    (empty: bit for bit everywhere). path: graphs / static-eager (the GraphRunner) / ragged-eager."""
    from sglang_ext.attention import causal_mask, plan_attention, prefix_and_tree_mask
    from sglang_ext.models.graph_runner import GraphRunner

    layers = tuple(range(len(model.layers)))
    g = torch.Generator().manual_seed(11)
    dev = model.device
    prompt = torch.randint(3, model.cfg.vocab_size, (n_prompt,), generator=g)
    ids, depth, tree_mask, chain_rows = _chain_with_siblings(chain, model.cfg.vocab_size, g)
    prompt_slots = torch.arange(1, n_prompt + 1)
    pools = []
    for _ in range(2):
        kv = model.new_kv_pool(2048)
        plan = plan_attention([prompt_slots.to(dev)], [causal_mask(n_prompt, 0, dev)], device=dev)
        model.forward(prompt.to(dev), torch.arange(n_prompt, device=dev), prompt_slots.to(dev), plan, kv)
        pools.append(kv)
    runner = GraphRunner(model, capture_layers=layers, graphs=path == "graphs")

    def forward(kv, tok, pos, slots, prefix, mask):  # -> ([T, H] hidden, {layer: [T, H]})
        if path == "ragged-eager":
            cols = torch.cat([prefix, slots]).to(dev)
            plan = plan_attention([cols], [prefix_and_tree_mask(mask, prefix.numel()).to(dev)], device=dev)
            out = model.forward(tok.to(dev), pos.to(dev), slots.to(dev), plan, kv, layers)
        else:
            out = runner.run([tok], [pos], [slots], [prefix], [mask], kv)
        return out.hidden, out.captured

    decoded = []  # the chain decoded one token per step, each committed before the next
    for k, row in enumerate(chain_rows):
        slot = torch.tensor([n_prompt + 1 + k])
        prefix = torch.arange(1, n_prompt + 1 + k)
        decoded.append(
            forward(
                pools[0],
                ids[row : row + 1],
                depth[row : row + 1] + n_prompt,
                slot,
                prefix,
                torch.eye(1, dtype=torch.bool),
            )
        )
    tree_slots = torch.arange(1000, 1000 + ids.numel())
    hidden, captured = forward(pools[1], ids, depth + n_prompt, tree_slots, prompt_slots, tree_mask)
    diffs = []
    for k, row in enumerate(chain_rows):
        h1, c1 = decoded[k]
        for li in layers:
            if not torch.equal(c1[li][0], captured[li][row]):
                diffs.append((k, li, (c1[li][0].float() - captured[li][row].float()).abs().max().item()))
                break
        else:
            if not torch.equal(h1[0], hidden[row]):
                diffs.append((k, "final norm", None))
        for li in layers:  # the K/V the tree row wrote is what the decode step committed
            same = torch.equal(pools[0].k[li][n_prompt + 1 + k], pools[1].k[li][1000 + row])
            if not same or not torch.equal(pools[0].v[li][n_prompt + 1 + k], pools[1].v[li][1000 + row]):
                diffs.append((k, f"kv of layer {li}", None))
                break
    return diffs


def together_and_alone(together, alone, tokens: list[list[int]], capture, check, rounds: int = 2) -> None:
    """Two drafters fed the same requests (rid = index in `tokens`): each round `check(batch)` compares the
    batched call on `together` with per-request calls on `alone`, then both commit the same two verified
    tokens per request. `capture(ids, start)` -> the TargetCapture of `ids` at positions start..."""
    from sglang_ext.drafters.base import DraftInput
    from sglang_ext.sampling import SamplingParams

    for rid, ids in enumerate(tokens):
        cap = capture(ids, 0)
        together.add_request(rid, cap)
        alone.add_request(rid, cap)
    for _ in range(rounds):  # the prompts, then two verified tokens each
        check([DraftInput(rid, ids + [7], SamplingParams(), None) for rid, ids in enumerate(tokens)])
        for rid, ids in enumerate(tokens):
            cap = capture([7, 8], len(ids))
            together.commit(rid, cap)
            alone.commit(rid, cap)
            tokens[rid] = ids + [7, 8]


def alone_or_batched(bs: int) -> slice:
    """The prompts an identity test at batch size bs takes: the odd ones alone, the even ones batched, so each
    prompt is checked once per drafter and shape."""
    return slice(1, None, 2) if bs == 1 else slice(0, None, 2)


class AdmissionLog(logging.Handler):
    """The admission queue's events (serving/tenancy.py's debug log: (event, tenant, seq), in the order they
    happened, under the queue's lock) and every `serving` log line, while in a `with` block."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.events: list[tuple[str, str, int]] = []
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "admission"):
            self.events.append(record.admission)
        self.lines.append(record.getMessage())

    def __enter__(self) -> AdmissionLog:
        self._serving = logging.getLogger("serving")
        self._level = self._serving.level
        self._serving.setLevel(logging.DEBUG)
        self._serving.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._serving.removeHandler(self)
        self._serving.setLevel(self._level)

    def queued_at_arrivals(self, tenant: str) -> list[tuple[int, set[int]]]:
        """For each request of `tenant` queued: (its seq, the seqs of other tenants' requests queued at that
        moment: queued before it, and not yet admitted, pushed out or removed)."""
        waiting: set[int] = set()
        out = []
        for event, who, seq in self.events:
            if event == "queued":
                if who == tenant:
                    out.append((seq, set(waiting)))
                else:
                    waiting.add(seq)
            elif event in ("admitted", "pushed out", "removed"):
                waiting.discard(seq)
        return out

    def admitted_before(self, seq: int) -> list[int]:
        """The seqs admitted before request `seq` was (all admitted ones when it never was)."""
        out = []
        for event, _, s in self.events:
            if event == "admitted":
                if s == seq:
                    return out
                out.append(s)
        return out


@dataclass
class Flood:
    """What a flooding tenant's clients got: each response's (status, Retry-After, body)."""

    results: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list = field(default_factory=list)

    def statuses(self) -> list[int]:
        return [r[0] for r in list(self.results)]


def flood(url: str, path: str, body: dict, key: str, clients: int, backoff_s: float = 0.2) -> Flood:
    """`clients` threads each sending `body` again and again with `key` until flood.stop is set, every response
    kept (a 429 is sent again after backoff_s: a client honouring Retry-After would wait longer)."""
    f = Flood()

    def client():
        with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as c:
            while not f.stop.is_set():
                r = c.post(path, json=body)
                f.results.append((r.status_code, r.headers.get("retry-after"), r.json()))
                if r.status_code == 429:
                    f.stop.wait(backoff_s)

    f.threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in f.threads:
        t.start()
    return f


def wait_for(what: str, condition, timeout: float = 120.0) -> None:
    """Poll `condition` until it holds (a wait, not a timing assertion: the deadline only ends a hung test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# --- GGUF blocks ---------------------------------------------------------------------------------

BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
GGML = {"Q4_1": GGMLQuantizationType.Q4_1, "Q8_0": GGMLQuantizationType.Q8_0}


def random_blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Valid random blocks: finite fp16 scale (and min), random quants."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 32, BLOCK_BYTES[kind]), dtype=np.uint8)
    blocks[:, :, 0:2] = rng.uniform(0.001, 0.05, size=(n, k // 32)).astype(np.float16)[..., None].view(np.uint8)
    if kind == "Q4_1":
        blocks[:, :, 2:4] = rng.uniform(-0.4, 0.0, size=(n, k // 32)).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def gguf_dequant(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """gguf's own numpy dequantizer: what the converter wrote as the fp32 weights."""
    return torch.from_numpy(dequantize(blocks.numpy(), GGML[kind]).reshape(blocks.shape[0], -1).astype(np.float32))


class QueuedStream(Stream):
    """A stand-in on the CPU for a GPU's stream (the overlapped loop's tests): the work the host issues (buffer
    fills, table writes, graph replays, device-to-host copies) is queued and run in order by a worker thread,
    and a copy's wait() blocks until the worker has run it. A "captured graph" is its function, run once at
    capture for its outputs and, at each replay, run again on the worker with its results written into those
    outputs (a graph's fixed buffers, overwritten by every replay).

    The worker runs a job only once the host waits for it or for a later one, so the device is as late as a
    stream allows: a host read of device state that does not go through to_host sees stale values, and so does
    the device of host state changed after the launch that reads it (the identity tests then fail). `log`
    records, in the host's order, ("replay", None), ("launch", name), ("copy", i) and ("read", i) (copy i
    waited for)."""

    asynchronous = graphs = True

    def __init__(self):
        super().__init__()
        self.log = []
        self._jobs: list = []
        self._cv = threading.Condition()
        self._issued = self._released = self._done = 0
        self._error: BaseException | None = None
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="queued-stream", daemon=True)
        self._worker.start()

    def close(self) -> None:
        """Run what is queued and end the worker thread (a torch thread left waiting at exit aborts the process)."""
        with self._cv:
            self._released, self._closed = self._issued, True
            self._cv.notify_all()
        self._worker.join()

    def launch(self, fn, *args) -> None:
        self.log.append(("launch", getattr(fn, "__name__", "fn")))
        self._put(lambda: fn(*args))

    def capture(self, fn, bufs: dict, pool):
        box = {}
        self._wait(self._put(lambda: box.setdefault("out", fn(bufs))))
        return _QueuedGraph(self, fn, bufs, box["out"]), box["out"], None

    def to_host(self, t: torch.Tensor) -> HostCopy:
        self.copies += 1
        i, buf = self.copies, torch.empty(t.shape, dtype=t.dtype)
        self.log.append(("copy", i))
        return HostCopy(buf, _QueuedEvent(self, self._put(lambda: buf.copy_(t)), i))

    def synchronize(self) -> None:
        self._wait(self._issued)

    @property
    def queued(self) -> int:
        """How many issued jobs have not run yet."""
        with self._cv:
            return self._issued - self._done

    def _put(self, job) -> int:
        with self._cv:
            self._jobs.append(job)
            self._issued += 1
            self._cv.notify_all()
            return self._issued

    def _wait(self, n: int) -> None:
        """Until job n (1-based) has run."""
        with self._cv:
            self._released = max(self._released, n)
            self._cv.notify_all()
            while self._done < n and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise RuntimeError("a job on the queued stream failed") from self._error

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._jobs and self._done < self._released):
                    if self._closed and not self._jobs:
                        return
                    self._cv.wait()
                job = self._jobs.pop(0)
            try:
                with torch.inference_mode():  # (as the model's forward runs)
                    job()
            except BaseException as e:  # noqa: BLE001 - the host hears of it at its next wait
                with self._cv:
                    self._error = e
            with self._cv:
                self._done += 1
                self._cv.notify_all()


class _QueuedEvent:
    def __init__(self, stream: QueuedStream, job: int, copy: int):
        self.stream, self.job, self.copy = stream, job, copy

    def synchronize(self) -> None:
        self.stream.log.append(("read", self.copy))
        self.stream._wait(self.job)


class _QueuedGraph:
    def __init__(self, stream: QueuedStream, fn, bufs: dict, out):
        self.stream, self.fn, self.bufs, self.out = stream, fn, bufs, out

    def replay(self) -> None:
        self.stream.log.append(("replay", None))
        self.stream._put(lambda: _write_into(self.out, self.fn(self.bufs)))


def _write_into(dst, src) -> None:
    """A replay's results into the captured outputs (tensors, in tuples, dicts and dataclasses)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src, strict=True):
            _write_into(a, b)
    elif isinstance(dst, dict):
        for k in dst:
            _write_into(dst[k], src[k])
    else:
        for f in fields(dst):
            _write_into(getattr(dst, f.name), getattr(src, f.name))


def log_cuda_copies(monkeypatch) -> list[tuple[str, int]]:
    """From now on, ("copy", n) as CUDA's stream issues its n-th device-to-host copy and ("read", n) as the host
    waits for it, in host order."""
    from sglang_ext.device import CudaStream, HostCopy

    log = []
    issue, wait = CudaStream.to_host, HostCopy.wait

    def to_host(self, t):
        copy = issue(self, t)
        copy.step = self.copies
        log.append(("copy", copy.step))
        return copy

    def read(self):
        log.append(("read", self.step))
        return wait(self)

    monkeypatch.setattr(CudaStream, "to_host", to_host)
    monkeypatch.setattr(HostCopy, "wait", read)
    return log


def copies_read_after_the_next(log: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """(the copies read, those read after the next copy was issued: their step N+1 went ahead of step N's read)."""
    at = {e: i for i, e in enumerate(log)}
    reads = [i for kind, i in log if kind == "read"]
    return reads, [i for i in reads if at.get(("copy", i + 1), len(log)) < at[("read", i)]]


def prefill_copies(log: list) -> list[int]:
    """The copies of the overlapped loop's arrivals' prefills in a QueuedStream's log (decode_step.launch_prefill:
    its launch, then at once its first tokens' copy)."""
    return [e[1] for e, before in zip(log[1:], log) if e[0] == "copy" and before == ("launch", "arrivals_prefill")]


def step_order(log: list) -> tuple[list[int], list[int]]:
    """(the steps' copies read after the next step's copy was issued, the steps' copies read before it), from a
    QueuedStream's log, the arrivals' prefills' copies aside (prefill_copies)."""
    at, skip = {e: i for i, e in enumerate(log)}, set(prefill_copies(log))
    steps = [i for kind, i in log if kind == "copy" and i not in skip]
    reads, after = [i for kind, i in log if kind == "read" and i not in skip], dict(zip(steps, steps[1:]))
    ahead = [i for i in reads if i in after and at[("copy", after[i])] < at[("read", i)]]
    return ahead, [i for i in reads if i not in ahead]


def prefills_in_flight(log: list) -> list[tuple[int | None, bool | None]]:
    """Per arrivals' prefill launched (decode_step.launch_prefill), in order, from a QueuedStream's log: (the copy of
    the step issued last before its launch, whether that copy was read before the launch), (None, None) where no step
    was issued before it."""
    out, skip = [], set(prefill_copies(log))
    for j, e in enumerate(log):
        if e == ("launch", "arrivals_prefill"):
            issued = [i for kind, i in log[:j] if kind == "copy" and i not in skip]
            out.append((issued[-1], ("read", issued[-1]) in log[:j]) if issued else (None, None))
    return out


def extend_whole_and_pair_by_pair(whole, stepwise, lengths: list[int], vocab: int, seed: int = 0) -> None:
    """EAGLE-3's draft-extend of whole prompts (`whole`, one batch) against the same prompts extended one verified pair
    at a time (`stepwise`: every pair through the whole layer): each request's root output and the draft K/V of every
    pair agree. Two drafters with the same target and draft."""
    from sglang_ext.drafters.base import DraftInput, TargetCapture
    from sglang_ext.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    h = whole.target.cfg.hidden_size
    prompts = [torch.randint(3, vocab, (n + 1,), generator=g).tolist() for n in lengths]  # n tokens and a root
    feats = [{l: torch.randn(n, h, generator=g) for l in whole.capture_layers} for n in lengths]

    def capture(rid: int, a: int, b: int) -> TargetCapture:
        at = torch.arange(a, b)
        return TargetCapture(prompts[rid][a:b], at, at, {l: f[a:b] for l, f in feats[rid].items()})

    def draft_input(rid: int, n: int) -> DraftInput:
        return DraftInput(rid, prompts[rid][: n + 1], SamplingParams(), None)

    with torch.inference_mode():
        for rid, n in enumerate(lengths):
            whole.add_request(rid, capture(rid, 0, n))
            stepwise.add_request(rid, capture(rid, 0, 1))
        out = whole._extend([draft_input(rid, n) for rid, n in enumerate(lengths)])
        for rid, n in enumerate(lengths):
            for j in range(1, n + 1):
                if j > 1:
                    stepwise.commit(rid, capture(rid, j - 1, j))
                alone = stepwise._extend([draft_input(rid, j)])
            tol = 1e-5 * alone.abs().max().item()
            torch.testing.assert_close(out[rid], alone[0], rtol=0, atol=tol)
            a, b = whole.reqs[rid].slots, stepwise.reqs[rid].slots
            assert a.numel() == b.numel() == n
            for pool_a, pool_b in ((whole.kv.k[0], stepwise.kv.k[0]), (whole.kv.v[0], stepwise.kv.v[0])):
                torch.testing.assert_close(pool_a[a], pool_b[b], rtol=0, atol=1e-5 * pool_b[b].abs().max().item())


def scripted_policy(shape, off):
    """The engine's adaptive policy with its choice scripted: off (option 0) at the decode steps in `off` (counted from
    1), the configured tree (option 1) at the others; `calls`: the steps chosen so far."""
    from serving.adaptive import AdaptiveSpeculation

    class Scripted(AdaptiveSpeculation):
        def choose(self, batch_size):
            self.calls += 1
            return 0 if self.calls in off else 1

    p = Scripted(shape)
    p.calls = 0
    return p


def off_stretches_run(target, drafter, prompts, params, off, shape, after_drafted=None) -> tuple[list, list, list]:
    """Requests served by an engine with `drafter`, speculation off at the steps in `off` (scripted_policy). -> (per
    step (its number, the drafter's commit calls in it), the token ids of every tree it proposed, step after step, the
    outputs); after_drafted(reqs) runs after each drafted step."""
    from serving.config import EngineConfig
    from serving.engine import Engine

    commits, trees = [], []
    commit, propose = drafter.commit, drafter.propose
    drafter.commit = lambda rid, cap: commits.append(rid) or commit(rid, cap)
    drafter.propose = lambda b, s: (lambda out: trees.append([t.draft_tokens.tolist() for t in out]) or out)(
        propose(b, s)
    )
    eng = Engine(target, drafter, EngineConfig(tree=shape))
    eng.policy = scripted_policy(eng.tree, off)
    reqs = [eng.add_request(p, params) for p in prompts]
    per_step = []
    while not all(r.finished for r in reqs):
        n, step = len(commits), eng.policy.calls
        eng.step()
        per_step.append((eng.policy.calls, len(commits) - n))
        if after_drafted is not None and eng.policy.calls > step and eng.policy.calls not in off:
            after_drafted(reqs)
    return per_step, trees, [r.output_ids for r in reqs]
