"""A request-to-slot table on the device (SGLang's `req_to_token`): row r holds, column by column, the
committed KV slots of the request that owns the row, so a graph reads each request's prefix from it on the
device instead of the host packing every prefix into the step's upload.

The host knows what each row holds: per request key, its row and how many of its leading slots the row has
(`synced`). A key's committed slots only grow, by appending (a decoding request's), while it is known; each
step the host sends only what a row lacks, as (flat table index, slot) pairs that the graph writes before it
reads the rows:

    the root's slot    a tree's root is always accepted: its new slot goes in at column prefix_len, so a
                       plain decode step leaves the row whole (nothing more to send next step)
    pending slots      the slots a row lacks: after a drafted step, the accepted drafts' slots (up to the
                       tree's depth); after a prefill or an eager step, the request's slots since

The pairs go in a fixed-size region of the step's upload (B*Q pairs: a drafted step's roots and accepted
drafts fit); a step with more to send (the first step after a prefill) writes the rest to the table
outside the graph first. Row 0 is scratch: padding requests read it (their columns are masked) and padding
pairs write slot 0 into its first column.

A step whose rows are all kept (`append`: a drafter's pass over newly verified tokens, its draft-extend) has
the graph write every real row's slot at column prefix_len + j (row j of the request; padding rows, whose
slot is 0, never handed out by a pool, write the scratch cell), so the row is whole after the step and a
later graph of the same step (the drafter's search) reads the extended prefix from it.

A graph that only reads the rows (a drafter's search: `pending`) gets what they lack as a fixed region of
pairs in its upload, written before it reads them; nothing, when an appending step made them whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from functools import lru_cache

import torch

from ..device import to_device


class SlotTable:
    """`rows` rows (row 0 scratch) of `width` columns of int64 slots on `device`, and the host's account of
    them per request key (least recently used rows go to new keys when none is free)."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.table = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.width = width
        self._known: OrderedDict[Hashable, list[int]] = OrderedDict()  # key -> [row, synced]
        self._free = list(range(rows - 1, 0, -1))

    def forget(self, key: Hashable) -> None:
        """The key's row is free (its request ended)."""
        entry = self._known.pop(key, None)
        if entry is not None:
            self._free.append(entry[0])

    def _rows(self, keys: list[Hashable], lens: list[int]) -> list[list[int]]:
        """Each key's [row, synced] (a new key gets a free row, else the least recently used row of a key not
        in this batch; a key whose slots are fewer than its row holds starts over)."""
        batch = set(keys)
        out = []
        for key, n in zip(keys, lens):
            entry = self._known.get(key)
            if entry is None:
                if not self._free:
                    old = next(k for k in self._known if k not in batch)
                    self._free.append(self._known.pop(old)[0])
                entry = self._known[key] = [self._free.pop(), 0]
            else:
                self._known.move_to_end(key)
            if entry[1] > n:
                entry[1] = 0
            out.append(entry)
        return out

    def inputs(
        self,
        bucket: tuple[int, int, int],
        keys: list[Hashable],
        q_lens: list[int],
        prefixes: list[torch.Tensor],  # per request [P_b] int64 host ids: its committed slots
        front: list[int],  # host ints filling the grids' real rows first (ids, then positions), or []
        vals: list[torch.Tensor],  # host int64 tensors filling the grids' real rows after `front` (slots last)
        append: bool = False,  # every real row's slot joins its request's row (read(append=True) writes them)
    ):
        """A keyed bucket's host inputs: one int64 tensor [ids | positions | out_slots (B*Q each) | rows [B] |
        prefix_len [B] | table index [S] | slot [S]] (S = B*Q; padding: 0), the pairs that did not fit in it
        (None, or a host tensor [2, M]: table indices, slots), and done() to call once the step ran (the rows
        then hold their roots). A fixed number of host ops for the batch: the host ints as one tensor, one cat
        with the tensors, one gather."""
        b, q, _ = bucket
        s, n = b * q, len(keys)
        lens = [t.numel() for t in prefixes]
        entries = self._rows(keys, lens)
        starts = [0]
        for k in q_lens[:-1]:
            starts.append(starts[-1] + k)
        pend = [i for i, (e, m) in enumerate(zip(entries, lens)) if e[1] < m]
        head = 1 + 2 * n  # src: [0 | rows | prefix lens | pair indices | front | vals | pending prefixes]
        at = [e[0] * self.width + m for e, m in zip(entries, lens)]  # the roots' cells
        extra_at = [e[0] * self.width + j for i in pend for e in (entries[i],) for j in range(e[1], lens[i])]
        ints = [0, *(e[0] for e in entries), *lens, *at, *extra_at, *front]
        off_grid = len(ints) - len(front)
        grid_n = len(front) + sum(t.numel() for t in vals)
        off_slots = off_grid + grid_n - sum(q_lens)  # out_slots are the last of vals
        off_pend = off_grid + grid_n
        extra_src, base = [], off_pend
        for i in pend:
            extra_src += range(base + entries[i][1], base + lens[i])
            base += lens[i]
        src = torch.cat([torch.tensor(ints, dtype=torch.long), *vals, *(prefixes[i] for i in pend)])
        g = [0] * (5 * s + 2 * b)
        first = 3 - grid_n // max(sum(q_lens), 1)
        at_src = off_grid  # grid k's real rows read src from here on, request after request (slices: few host steps)
        for k in range(first, 3):
            for i, m in enumerate(q_lens):
                g[k * s + i * q : k * s + i * q + m] = range(at_src, at_src + m)
                at_src += m
        g[3 * s : 3 * s + n] = range(1, 1 + n)
        g[3 * s + b : 3 * s + b + n] = range(1 + n, 1 + 2 * n)
        pairs_at = list(range(head, head + n))  # the roots' cells in src
        pairs_src = [off_slots + st for st in starts]
        overflow = None
        if n + len(extra_at) <= s:
            pairs_at += range(head + n, head + n + len(extra_at))
            pairs_src += extra_src
        elif extra_at:  # NOTE: written outside the graph, before it: a step after a prefill
            idx = torch.tensor([*range(head + n, head + n + len(extra_at)), *extra_src], dtype=torch.long)
            overflow = src[idx].view(2, -1)
        pairs = 3 * s + 2 * b
        g[pairs : pairs + len(pairs_at)] = pairs_at
        g[pairs + s : pairs + s + len(pairs_src)] = pairs_src
        longs = src[torch.tensor(g, dtype=torch.long)]

        def done() -> None:
            for e, m, k in zip(entries, lens, q_lens):
                e[1] = m + (k if append else 1)

        return longs, overflow, done

    def catch_up(self, keys: list[Hashable], prefixes: list[torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
        """(each key's row, the pairs [2, M] host int64 its row lacks of its prefix, or None): for a graph that
        writes a row's next cells itself (models/spec_graphs.py); the host then counts the rows whole (`account`)."""
        lens = [t.numel() for t in prefixes]
        entries = self._rows(keys, lens)
        at, src = self._lacking(entries, lens)
        if not at:
            return [e[0] for e in entries], None
        slots = torch.cat(prefixes)[torch.tensor(src, dtype=torch.long)]
        return [e[0] for e in entries], torch.stack([torch.tensor(at, dtype=torch.long), slots])

    def _lacking(self, entries: list, lens: list[int]) -> tuple[list[int], list[int]]:
        """The table cells the rows lack of their prefixes (each row holds its first `synced` slots) and, for each,
        its slot's index into the prefixes laid one after another."""
        at, src, base = [], [], 0
        for (row, synced), m in zip(entries, lens):
            at += range(row * self.width + synced, row * self.width + m)
            src += range(base + synced, base + m)
            base += m
        return at, src

    def rows_of(self, keys: list[Hashable]) -> list[int] | None:
        """Each key's row, when every key has one (None otherwise); the accounts stay as they are."""
        entries = [self._known.get(k) for k in keys]
        if any(e is None for e in entries):
            return None
        for k in keys:
            self._known.move_to_end(k)
        return [e[0] for e in entries]

    def account(self, key: Hashable, synced: int) -> None:
        """The key's row holds its first `synced` slots (a graph wrote cells the host learnt of later)."""
        entry = self._known.get(key)
        if entry is not None:
            entry[1] = min(synced, self.width)

    def write(self, pairs: torch.Tensor) -> None:
        """pairs [2, M] host int64 (table indices, slots) into the table (outside a graph)."""
        at, slots = to_device(pairs, self.table.device).unbind(0)
        self.table.view(-1)[at] = slots

    def read(self, longs: torch.Tensor, bucket: tuple[int, int, int], append: bool = False):
        """Inside the graph: a keyed bucket's flat buffer -> (ids, positions, out_slots [B*Q], prefix [B, P],
        prefix_len [B]), the pairs written into the table first; append: then every real row's slot (slot > 0)
        at its request's column prefix_len + j (see the module docstring)."""
        b, q, p = bucket
        s = b * q
        ids, pos, slots, rows, prefix_len, at, new = longs.split([s, s, s, b, b, s, s])
        flat = self.table.view(-1)
        flat.index_put_((at,), new)
        if append:
            cells = (rows * self.width + prefix_len)[:, None] + torch.arange(q, device=rows.device)
            flat.index_put_((torch.where(slots.view(b, q) > 0, cells, 0).view(-1),), slots)
        return ids, pos, slots, self.table[:, :p].index_select(0, rows), prefix_len

    def pending(self, keys: list[Hashable], prefixes: list[torch.Tensor], room: int, launch=None):
        """For a graph that writes `room` (table index, slot) pairs into the table before it reads the keys' rows:
        (each key's row, the pairs' table indices [room] ints, their slots [room] int64 host tensor (padding: 0
        into the scratch cell 0), done() to call once the graph ran). Pairs beyond `room` are written to the
        table now, outside the graph, through launch(fn, *args) (the graphs' Stream.launch: in order with the
        graphs issued before, which may still write a row a new key takes over; None: at once). A fixed number
        of host ops for the batch: the prefixes' one cat, one gather."""
        lens = [t.numel() for t in prefixes]
        entries = self._rows(keys, lens)
        at, src = self._lacking(entries, lens)
        base = sum(lens)
        if not at:  # (the rows hold every prefix: an appending graph ran since)
            return [e[0] for e in entries], [0] * room, _padding(room), lambda: None
        flat = torch.cat([*prefixes, _ZERO])  # (its last cell: the padding pairs' slot 0)
        if len(at) > room:  # NOTE: outside the graph, before it: a search after a prefill or eager steps
            over = torch.tensor([*at[room:], *src[room:]], dtype=torch.long).view(2, -1)
            (launch or (lambda fn, *args: fn(*args)))(self.write, torch.stack([over[0], flat[over[1]]]))
            at, src = at[:room], src[:room]
        slots = flat[torch.tensor(src + [base] * (room - len(src)), dtype=torch.long)]

        def done() -> None:
            for e, m in zip(entries, lens):
                e[1] = m

        return [e[0] for e in entries], at + [0] * (room - len(at)), slots, done

    def appended(self, keys: list[Hashable], lens: list[int], adds: list[int]):
        """For a graph that appends adds[i] slots to key i's row (whose first lens[i] slots it may hold): (the
        cells they go to [sum adds] ints, request after request; 0, the scratch cell, past the row's width; done()
        to call once the graph wrote them). A row that held its first lens[i] slots then holds lens[i] + adds[i]."""
        entries = self._rows(keys, lens)
        cells = [
            e[0] * self.width + j if j < self.width else 0
            for e, n, k in zip(entries, lens, adds)
            for j in range(n, n + k)
        ]

        def done() -> None:
            for e, n, k in zip(entries, lens, adds):
                if e[1] == n and n + k <= self.width:
                    e[1] = n + k

        return cells, done


_ZERO = torch.zeros(1, dtype=torch.long)


@lru_cache(maxsize=16)
def _padding(n: int) -> torch.Tensor:
    """n int64 zeros on the host (a padding template, never written)."""
    return torch.zeros(n, dtype=torch.long)


def real_rows(q_lens: list[int], q: int, base: int = 0) -> list[int]:
    """The flat rows base + b*Q + j (j < q_lens[b]) the requests' rows fill in a bucket of Q rows per request."""
    out = []
    for i, n in enumerate(q_lens):
        out += range(base + i * q, base + i * q + n)
    return out
