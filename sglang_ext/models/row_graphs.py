"""A drafter's function over rows that each stand alone (MoA's commit of verified tokens: each token's LSA memory, CA
and SA K/V; no attention across tokens) at bucketed row counts (`RowRunner`): its int64 fields in one upload, one
graph per row bucket on CUDA with graphs on, else run eagerly on the same buffer; or prepared (`Rows`) and run first
in a search's graph (models/draft_graphs.py: SearchRunner.run's `first`), in that graph's upload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from .graph_runner import GraphCache, bucket, fill_flat

ROW_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass
class Rows:
    """A row function's call at R rows (RowRunner.prepare): fn(*fields), its fields host ints first, then host
    int64 tensors, each [t] padded with 0 to R. Run alone (RowRunner.run_rows) or first in a search's graph
    (SearchRunner.run's `first`: one upload and one replay for both)."""

    fn: Callable[..., None]
    r: int
    ints: list[list[int]]  # each [t]
    tensors: list[torch.Tensor]  # each [t] int64 on the host

    @property
    def shape(self) -> tuple[int, int, int]:
        """(R, host int fields, tensor fields): what shapes a graph that runs it."""
        return self.r, len(self.ints), len(self.tensors)

    def host_ints(self) -> list[int]:
        pad = [0] * (self.r - self.t)
        return [x for f in self.ints for x in (*f, *pad)]

    def host_tensors(self) -> list[torch.Tensor]:
        pad = self.r - self.t
        return [y for x in self.tensors for y in ((x, host_zeros(pad)) if pad else (x,))]

    def blank(self) -> "Rows":
        """The same call with every field padding (what a graph is captured over)."""
        return Rows(self.fn, self.r, [[] for _ in self.ints], [host_zeros(0) for _ in self.tensors])

    @property
    def t(self) -> int:
        return len(self.ints[0]) if self.ints else self.tensors[0].numel()


class RowRunner:
    """fn(*fields) over R rows, each row alone, at a bucketed row count R: its int64 fields [F, R] (host values)
    in one upload, padded with 0 (token 0, position 0, slot 0: a padded row reads and writes the scratch slot 0
    only); captured per bucket on CUDA with graphs on, else run eagerly on the same buffer. fn's outputs are
    its writes (into pools); it returns nothing the caller reads. `runs` counts its calls, alone or first in a
    search's graph."""

    def __init__(
        self,
        fn: Callable[..., None],
        fields: int,
        device: torch.device | str,
        graphs: bool = True,
        buckets: tuple[int, ...] = ROW_BUCKETS,
    ):
        self.fn, self.fields, self.buckets = fn, fields, tuple(buckets)
        self.cache = GraphCache(torch.device(device), graphs)
        self._pools: tuple = ()
        self.runs = 0

    def bucket_of(self, t: int) -> int | None:
        return bucket(t, self.buckets) if t > 0 else None

    def prepare(self, ints: list[list[int]], tensors: list[torch.Tensor]) -> Rows | None:
        """The call over these fields (`ints` first, each [t] host ints, then `tensors`, each [t] int64 on the
        host), or None when t fits no bucket."""
        t = len(ints[0]) if ints else tensors[0].numel()
        r = self.bucket_of(t)
        return None if r is None else Rows(self.fn, r, ints, tensors)

    def run(self, ints: list[list[int]], tensors: list[torch.Tensor], pools: tuple) -> bool:
        """prepare, then run_rows; False (nothing run) when t fits no bucket."""
        rows = self.prepare(ints, tensors)
        if rows is not None:
            self.run_rows(rows, pools)
        return rows is not None

    def run_rows(self, rows: Rows, pools: tuple) -> None:
        """The prepared call alone; pools: what fn writes and reads (graphs bake their addresses in)."""
        if len(pools) != len(self._pools) or any(a is not c for a, c in zip(pools, self._pools)):
            self.cache.clear()
            self._pools = tuple(pools)
        self.runs += 1
        r = rows.r
        host = torch.cat([torch.tensor(rows.host_ints(), dtype=torch.long), *rows.host_tensors()])
        f = self.fields

        def make() -> dict:
            return {"longs": torch.zeros(f * r, dtype=torch.long, device=self.cache.device)}

        self.cache.run(
            r, make, lambda bufs: fill_flat(bufs["longs"], host), lambda bufs: self.fn(*bufs["longs"].view(f, r))
        )
        return True


@lru_cache(maxsize=64)
def host_zeros(n: int) -> torch.Tensor:
    """n int64 zeros on the host (a padding template, never written)."""
    return torch.zeros(n, dtype=torch.long)
