"""The request-to-slot table on the device (sglang_ext/models/slot_table.py) and the graph runner's keyed
steps over it: whatever a step's requests did since their last step (a plain decode, a drafted step's
accepted drafts, a prefill, steps the runner never saw), the rows a graph reads hold exactly each request's
committed slots; rows of ended requests are reused; a plain greedy decode step's in-graph argmax is the
argmax of the eager forward's logits."""

from __future__ import annotations

import random

import torch
from helpers import tiny_target

from sglang_ext.attention import causal_mask, plan_attention
from sglang_ext.models.decode_graphs import decode
from sglang_ext.models.graph_runner import GraphRunner
from sglang_ext.models.slot_table import SlotTable, real_rows


def _step(table: SlotTable, bucket, keys, q_lens, prefixes, rng, append=False):
    """One keyed step on the table (CPU): its inputs, the overflow written, then what the graph reads."""
    b, q, p = bucket
    t = sum(q_lens)
    ids = [rng.randrange(100) for _ in range(t)]
    out_slots = torch.tensor([rng.randrange(1, 10_000) for _ in range(t)])
    pos = [len(x) + j for x, n in zip(prefixes, q_lens) for j in range(n)]
    longs, overflow, done = table.inputs(bucket, keys, q_lens, prefixes, [*ids, *pos], [out_slots], append)
    if overflow is not None:
        table.write(overflow)
    got_ids, got_pos, got_slots, prefix, prefix_len = table.read(longs, bucket, append)
    rows = real_rows(q_lens, q)
    assert got_ids[rows].tolist() == ids and got_pos[rows].tolist() == pos
    assert got_slots[rows].tolist() == out_slots.tolist()
    assert prefix_len[: len(keys)].tolist() == [len(x) for x in prefixes] and not prefix_len[len(keys) :].any()
    for i, x in enumerate(prefixes):
        assert prefix[i, : len(x)].tolist() == x.tolist(), (i, keys[i])
    done()
    return out_slots.split(q_lens)


def test_the_rows_a_graph_reads_hold_every_requests_slots():
    rng = random.Random(0)
    table = SlotTable(rows=5, width=65, device=torch.device("cpu"))  # 4 rows for 6 requests: rows are reused
    slots = {k: torch.tensor([rng.randrange(1, 10_000) for _ in range(rng.randrange(1, 20))]) for k in range(6)}
    for _ in range(40):
        keys = rng.sample(sorted(slots), rng.randrange(1, 4))
        q_lens = [rng.choice([1, 1, 3, 4]) for _ in keys]
        bucket = (4, 4, 64)
        news = _step(table, bucket, keys, q_lens, [slots[k] for k in keys], rng)
        for k, n, new in zip(keys, q_lens, news):
            # the root is always kept; a drafted tree's accepted nodes in any order after it
            kept = [new[0].item()] + rng.sample(new[1:].tolist(), rng.randrange(n))
            grown = torch.cat([slots[k], torch.tensor(kept)])
            if rng.random() < 0.2:  # steps the runner did not see (eager): more slots appended
                grown = torch.cat([grown, torch.randint(1, 10_000, (rng.randrange(1, 9),))])
            slots[k] = grown[:60]
        if rng.random() < 0.15:  # a request ends, a new one starts
            gone = rng.choice(sorted(slots))
            table.forget(gone)
            del slots[gone]
            slots[max(slots, default=0) + 100] = torch.randint(1, 10_000, (rng.randrange(1, 30),))


def test_an_appending_step_leaves_each_row_holding_every_slot_of_its_request():
    """Steps that keep all their rows (a drafter's draft-extend: read(append=True)) between steps that keep only
    their roots, and reads that send what the rows lack (a drafter's search: `pending`, its pairs written as a graph
    would, those beyond its room outside it): after an appending step or a read, each request's row holds its
    prefix and all its new slots (a read after an appending step sends nothing), and so after slots appended at
    the cells `appended` gives."""
    rng = random.Random(2)
    table = SlotTable(rows=4, width=65, device=torch.device("cpu"))
    slots = {k: torch.randint(1, 10_000, (rng.randrange(1, 12),)) for k in range(3)}
    for step in range(12):
        keys = rng.sample(sorted(slots), rng.randrange(1, 4))
        q_lens = [rng.randrange(1, 5) for _ in keys]
        append = step % 3 != 2
        news = _step(table, (4, 4, 64), keys, q_lens, [slots[k] for k in keys], rng, append)
        for k, new in zip(keys, news):  # (every new slot kept: a root-only step's row lacks its accepted drafts)
            slots[k] = torch.cat([slots[k], new])
        rows, cells, pairs, done = table.pending(keys, [slots[k] for k in keys], room=4)
        lacking = sum(n - 1 for n in q_lens) if not append else 0
        assert sum(c > 0 for c in cells) == min(lacking, 4) and len(cells) == pairs.numel() == 4
        table.table.view(-1)[torch.tensor(cells)] = pairs  # (as the graph writes them)
        done()
        assert all(torch.equal(table.table[r, : slots[k].numel()], slots[k]) for r, k in zip(rows, keys))
        # a graph appending slots it made (MoA's commit) at the cells `appended` gives: nothing lacking after it
        adds = [rng.randrange(1, 4) for _ in keys]
        cells, done = table.appended(keys, [slots[k].numel() for k in keys], adds)
        new = torch.randint(1, 10_000, (sum(adds),))
        table.table.view(-1)[torch.tensor(cells)] = new
        done()
        for k, x in zip(keys, new.split(adds)):
            slots[k] = torch.cat([slots[k], x])
        assert not any(table.pending(keys, [slots[k] for k in keys], room=4)[1])


def _three_prefilled(pool: int, seed: int):
    """A tiny model, its KV pool and three prompts (5, 12, 3 random tokens) prefilled: (model, kv, generator,
    the prompts' slots)."""
    model = tiny_target(vocab=64, hidden=64, heads=4, kv_heads=2).model
    kv = model.new_kv_pool(pool)
    g = torch.Generator().manual_seed(seed)
    prefixes = []
    for n in (5, 12, 3):
        s = kv.alloc(n)
        ids = torch.randint(0, 64, (n,), generator=g)
        model.forward(ids, torch.arange(n), s, plan_attention([s], [causal_mask(n, 0)]), kv)
        prefixes.append(s)
    return model, kv, g, prefixes


def test_a_plain_decode_steps_argmax_in_the_graph_is_the_eager_logits_argmax():
    model, kv, g, prefixes = _three_prefilled(pool=512, seed=1)
    runner, ref = GraphRunner(model, graphs=False), GraphRunner(model, graphs=False)
    for step in range(3):
        tokens = torch.randint(0, 64, (3,), generator=g).tolist()
        out_slots = kv.alloc(3)
        got = decode(runner, [7, 8, 9], tokens, out_slots, prefixes, kv).tolist()
        one = [torch.tensor([t]) for t in tokens]
        pos = [torch.tensor([len(p)]) for p in prefixes]
        eye = [torch.ones(1, 1, dtype=torch.bool)] * 3
        out = ref.run(one, pos, list(out_slots.split(1)), prefixes, eye, kv)
        assert got == model.logits(out.hidden).argmax(-1).tolist(), step
        prefixes = [torch.cat([p, s]) for p, s in zip(prefixes, out_slots.split(1))]
    assert runner.runs == 3


def test_a_plain_decode_step_sends_only_its_roots():
    """After a request's first step (its prompt's slots, more than the upload's pairs hold, written to the
    table outside the graph), each plain decode step sends one pair: its root's cell, nothing outside."""
    rng = random.Random(1)
    table = SlotTable(rows=3, width=65, device=torch.device("cpu"))
    prefix = torch.randint(1, 10_000, (30,))
    for step in range(4):
        longs, overflow, _ = table.inputs((1, 1, 64), [5], [1], [prefix], [], [torch.tensor([0])])
        assert (overflow is not None) == (step == 0)
        new = _step(table, (1, 1, 64), [5], [1], [prefix], rng)[0]
        if step:  # (pairs from index 5: the bucket's three grids and two lengths come first)
            row = next(r for r in (1, 2) if table.table[r, 0] == prefix[0])
            assert longs[5].item() == row * 65 + len(prefix)  # the one pair: the root's cell
        prefix = torch.cat([prefix, new])


def test_a_verify_steps_greedy_paths_in_the_graph_are_greedy_paths_on_the_eager_argmax():
    """Trees of several sizes in one bucket (rows placed by index; a step after a larger tree leaves nothing
    behind), drafts the target agrees with at depth 1, a draft outside the vocabulary: the graph's paths, argmax
    and flags are greedy_paths' over the argmax of the same forward's logits."""
    from sglang_ext.tree import tree_from_parents
    from sglang_ext.verify import greedy_paths

    model, kv, g, prefixes = _three_prefilled(pool=1024, seed=3)
    runner, ref = GraphRunner(model, graphs=False), GraphRunner(model, graphs=False)
    shapes = ([[-1, 0, 0], [-1], [-1, 0, 0, 1, 1, 3]], [[-1, 0, 1, 0, 2], [-1, 0], [-1, 0, 0]])
    for step, parents in enumerate(shapes):
        toks = [torch.randint(0, 64, (len(p),), generator=g) for p in parents]

        def trees(toks=toks, parents=parents):
            return [tree_from_parents(t, torch.tensor(p), len(x)) for t, p, x in zip(toks, parents, prefixes)]

        def forward(r, ts, **kw):
            slots = [kv.alloc(t.num_nodes) for t in ts]
            args = ([t.draft_tokens for t in ts], [t.positions for t in ts], slots, prefixes)
            out = r.run(*args, [t.tree_mask for t in ts], kv, **kw)
            for s in slots:
                kv.free(s)
            return out

        first = model.logits(forward(ref, trees()).hidden).argmax(-1).split([len(p) for p in parents])
        for t, p, a in zip(toks, parents, first):  # each root's children: the target's token there, then others
            t[[i for i, q in enumerate(p) if q == 0][:1]] = a[0]
        toks[2][-1] = 64 + step  # (outside the vocabulary: never accepted, flagged)
        out, greedy = forward(runner, trees(), keys=[10, 11, 12], trees=trees())
        want = greedy_paths(trees(), model.logits(forward(ref, trees()).hidden).argmax(-1), 64)
        got = greedy.paths(trees(), [0, 1, 2])
        assert torch.equal(greedy.argmax, greedy.logits.argmax(-1))
        for w, x in zip(want, got):
            assert w.nodes.tolist() == x.nodes.tolist() and w.tokens.tolist() == x.tokens.tolist()
            assert (w.draft_invalid is None) == (x.draft_invalid is None) and bool(w.draft_invalid) == bool(
                x.draft_invalid
            )
        assert max(len([n for n in w.nodes.tolist() if n >= 0]) for w in want) >= 2  # a draft accepted somewhere
        assert bool(got[2].draft_invalid) and not any(bool(x.draft_invalid) for x in got[:2])
        assert torch.equal(greedy.paths(trees()[1:], [1, 2])[1].tokens, got[2].tokens)
