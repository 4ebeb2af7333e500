"""Benchmarks on top of the product: `moa-serve bench` (bench.py: drafters at bs 1, interleaved with
their peers from peers.py; batch.py: batch sweeps and gateway overhead), `moa-serve edge` / `edge-bench`
(edge.py, links emulated by netem.py) and `evaluate.py` (tau of a checkpoint;
`python -m moa_serve.entrypoints.evaluate`)."""
