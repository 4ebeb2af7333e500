"""The suffix drafter's seed corpus from the target's own answers.

Input: conversation files, normally the output of `moa-serve distill` (the target's greedy answers
to ShareGPT prompts, eval prompts excluded). Every assistant turn is tokenized with the target's
tokenizer; an answer that ended naturally (`finish_reason` "stop", or no finish_reason recorded) is
followed by the end-of-turn token, so the drafter also learns where answers end. Output: a corpus
directory (config.json + corpus.npz) that `--drafter PATH` or the shipped `--drafter suffix` loads.
"""

from __future__ import annotations


def corpus_docs(
    sources: list[str], encode, end_id: int | None, max_docs: int | None = None
) -> tuple[list[list[int]], int]:
    """(token docs, conversations read): assistant turns of each conversation (eval prompts excluded,
    as in training), end-of-turn appended unless the answer was cut off."""
    from .data import eval_prompts, open_conversations

    excluded = eval_prompts()
    docs: list[list[int]] = []
    n_conv = 0
    for source in sources:
        for conv in open_conversations(source, excluded):
            n_conv += 1
            answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
            for j, text in enumerate(answers):
                ids = list(encode(text))
                if end_id is not None and (conv.finish_reason in (None, "stop") or j < len(answers) - 1):
                    ids.append(end_id)
                docs.append(ids)
                if max_docs is not None and len(docs) >= max_docs:
                    return docs, n_conv
    return docs, n_conv
