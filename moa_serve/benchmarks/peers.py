"""Peers for `moa-serve bench`: other stacks decoding the same prompts on the same machine, in the same run.

- hf-generate: transformers `generate`, plain decoding.
- hf-assisted: transformers assisted generation; the assistant is our draft-model self-draft (the
  target's first layers + last two, weights shared with the HF target, not copied).
- hf-prompt-lookup: transformers `generate(prompt_lookup_num_tokens=...)`.
- llama.cpp / llama.cpp-prompt-lookup: `llama-cpp-python` on the very GGUF file our default target
  is dequantized from (so it runs the Q4_1 weights), plain and with its prompt-lookup draft model.

A runner is a function prompt ids -> (output ids, stats or None), like the engine runners in bench.py.
Speculative peers report stats measured from their own loops: each target forward is recorded as
(sequence length before it, draft tokens it verified); what it accepted follows from the next one.
A peer that cannot run raises PeerUnavailable (the bench reports it as skipped, with the reason).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

PEERS = ("hf-generate", "hf-assisted", "hf-prompt-lookup", "llama.cpp", "llama.cpp-prompt-lookup")


class PeerUnavailable(Exception):
    """The peer cannot run here (not installed, no GGUF, unsupported setting): skipped, with this reason."""


@dataclass
class PeerStats:
    """Same counters as the engine's RequestStats, so the bench pools both alike."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)
    max_draft: int = 0  # longest draft seen: the number of draft positions this request had


def stats_from_steps(steps: list[tuple[int, int]], final_len: int) -> PeerStats:
    """steps: per target forward, (sequence length before it, draft tokens it verified); final_len: prompt + output.

    A forward yields (accepted + 1) tokens, so what step k accepted is the growth to the next step
    minus one (the last step: to final_len, which is clipped by max_new_tokens / EOS, like our engine's
    output). A first forward without drafts is the prefill, not a verify step (as in our engine)."""
    st = PeerStats()
    for k, (seq_len, drafted) in enumerate(steps):
        next_len = steps[k + 1][0] if k + 1 < len(steps) else final_len
        if k == 0 and drafted == 0:
            continue
        accepted = max(0, min(drafted, next_len - seq_len - 1))
        st.verify_steps += 1
        st.draft_tokens += drafted
        st.accepted_tokens += accepted
        st.max_draft = max(st.max_draft, drafted)
        while len(st.accepted_by_depth) < accepted:
            st.accepted_by_depth.append(0)
        for i in range(accepted):
            st.accepted_by_depth[i] += 1
    return st


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 28, 29] -> "0-2,28-29" (the table's description of a self-draft)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def sampling_label(sp) -> str:
    return "greedy" if sp.greedy else f"T={sp.temperature:g}, top-p={sp.top_p:g}, seed={sp.seed}"


# --- transformers --------------------------------------------------------------------------------


def load_hf_model(target, dtype: torch.dtype, cache: dict, device: str | torch.device = "cpu"):
    """The target as a transformers model on `device` (the GPU our engine runs on, so the comparison
    is on the same chip), loaded once per run and shared by every HF peer."""
    if "hf" not in cache:
        if target.path is None:
            raise PeerUnavailable("the target has no Hugging Face directory to load transformers from")
        from transformers import AutoModelForCausalLM

        cache["hf"] = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).to(device).eval()
    return cache["hf"]


def hf_self_draft_assistant(hf_model, layers: list[int]):
    """Our draft-model drafter as a transformers model: the target's `layers` (in order) with its own
    embedding, final norm, rotary table and lm_head. Parameters are the target's tensors (assigned,
    not copied); the layers are renumbered 0..n-1 so the assistant's KV cache indexes them right."""
    cfg = copy.deepcopy(hf_model.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    with torch.device("meta"):
        assistant = type(hf_model)(cfg)
    index = {old: new for new, old in enumerate(layers)}
    state = {}
    for name, t in hf_model.state_dict().items():
        if name.startswith("model.layers."):
            old = int(name.split(".")[2])
            if old in index:
                state[name.replace(f"model.layers.{old}.", f"model.layers.{index[old]}.", 1)] = t
        else:
            state[name] = t
    assistant.load_state_dict(state, assign=True, strict=True)
    assistant.model.rotary_emb = hf_model.model.rotary_emb  # non-persistent buffers are not in the state dict
    left = [n for n, t in [*assistant.named_parameters(), *assistant.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"assistant tensors not taken from the target: {left}")
    return assistant.eval()


def _record_forwards(hf_model) -> list[tuple[int, int]]:
    """Record (sequence length, draft length) of every candidate set `generate` verifies on this model.

    Wraps the model's candidate generator (transformers' assisted / prompt-lookup loop asks it for
    candidates once per target forward). Installed once per model; every HF runner clears the list."""
    if hasattr(hf_model, "_bench_forwards"):
        return hf_model._bench_forwards
    steps: list[tuple[int, int]] = []
    make_generator = hf_model._get_candidate_generator

    def recording_generator(*args, **kwargs):
        gen = make_generator(*args, **kwargs)
        get = gen.get_candidates

        def get_candidates(input_ids, *a, **kw):
            candidates, logits = get(input_ids, *a, **kw)
            steps.append((input_ids.shape[1], candidates.shape[1] - input_ids.shape[1]))
            return candidates, logits

        gen.get_candidates = get_candidates
        return gen

    hf_model._get_candidate_generator = recording_generator
    hf_model._bench_forwards = steps
    return steps


def hf_runner(hf_model, sp, eos_ids: list[int], **mode):
    """transformers `generate` with `mode` (nothing: plain; assistant_model=...; prompt_lookup_num_tokens=...).

    Sampling: do_sample with the same temperature / top-p, top-k off, torch seeded per prompt."""
    sample = (
        {"do_sample": False}
        if sp.greedy
        else {"do_sample": True, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": 0}
    )
    steps = _record_forwards(hf_model) if mode and hasattr(hf_model, "_get_candidate_generator") else None
    eos = list(eos_ids) or None

    def run(prompt):
        if steps is not None:
            steps.clear()
        if sp.seed is not None:
            torch.manual_seed(sp.seed)
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([prompt], device=hf_model.device),
                max_new_tokens=sp.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else 0,
                **sample,
                **mode,
            )
        ids = out[0, len(prompt) :].tolist()
        return ids, (stats_from_steps(list(steps), len(prompt) + len(ids)) if steps else None)

    return run


# --- llama.cpp -----------------------------------------------------------------------------------


def target_gguf(model_name: str):
    """The GGUF our target is loaded from, or PeerUnavailable (only the default target ships as one)."""
    from sglang_ext.models.loader import DEFAULT_TARGET, ModelLoadError, smollm2_gguf_path

    if model_name != DEFAULT_TARGET:
        raise PeerUnavailable(
            f"--model {model_name} is a Hugging Face directory; llama.cpp needs the GGUF the target comes from"
        )
    try:
        return smollm2_gguf_path()
    except ModelLoadError as e:
        raise PeerUnavailable(str(e)) from e


def llama_cpp_build() -> str | None:
    """llama-cpp-python's version and the CPU features its build uses (ggml's system info), for the bench's
    machine line; None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    info = llama_cpp.llama_print_system_info().decode()
    features = [f.split("=")[0].split(":")[-1].strip() for f in info.split("|") if f.strip().endswith("= 1")]
    return f"{llama_cpp.__version__} ({', '.join(features)})"


def llama_cpp_runner(gguf_path, sp, eos_ids: list[int], n_ctx: int, threads: int, lookup_tokens: int | None = None):
    """llama-cpp-python on the GGUF: greedy (temp 0) or the same temperature / top-p (top-k, min-p off,
    no repeat penalty), seeded; with lookup_tokens, its LlamaPromptLookupDecoding draft model.

    The context is reset before every prompt, so no prompt reuses KV from an earlier one (our engine
    does not either)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        raise PeerUnavailable(f"llama_cpp not importable ({e}); `make bench-peers` builds llama-cpp-python") from e
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
    # NOTE: llama-cpp-python 0.3.36 keeps logits for every token when a draft model is set, but sizes
    # its score buffer from the logits_all *argument* (n_batch rows unless it is True), so any prompt
    # longer than n_batch (512) fails ("could not broadcast ... into shape (0,)"): pass it explicitly.
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,
        logits_all=draft is not None,
        verbose=False,
    )
    evals: list[tuple[int, int]] = []  # (tokens already in the KV cache, tokens in this eval)
    evaluate = llm.eval

    def recording_eval(tokens):
        evals.append((llm.n_tokens, len(tokens)))
        return evaluate(tokens)

    llm.eval = recording_eval
    eos = set(eos_ids)

    def run(prompt):
        llm.reset()
        llm.set_seed(sp.seed if sp.seed is not None else 0)
        evals.clear()
        out: list[int] = []
        for tok in llm.generate(
            prompt, temp=sp.temperature, top_p=sp.top_p, top_k=0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0
        ):
            out.append(int(tok))
            if tok in eos or len(out) >= sp.max_new_tokens:
                break
        if draft is None:
            return out, None
        # After the prompt, an eval is [last sampled token] + drafts on top of the accepted KV.
        steps = [(n, 0) if past == 0 else (past + 1, n - 1) for past, n in evals]
        return out, stats_from_steps(steps, len(prompt) + len(out))

    return run
