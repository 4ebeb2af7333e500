"""The project's namespace for what sits above the serving stack: `moa_serve.benchmarks` (benchmarks on top
of the product) and `moa_serve.entrypoints` (the `moa-serve` command line). The layers below keep their
promised top-level names: `sglang_ext` (the speculative core and the SGLang plugin) and `serving`."""
