"""The turns `moa-serve distill` asks (dialogues.TurnQueue), with a word-count 'tokenizer': later turns
after the target's own answers, samples with their own seeds, the prompt limit, resuming mid-dialogue."""

from __future__ import annotations

import pytest

from sglang_ext.training.data import Conversation
from sglang_ext.training.dialogues import TurnQueue, record_key


def _conv(cid: str, *users: str, system: str | None = None) -> Conversation:
    msgs = [{"role": "system", "content": system}] if system else []
    for u in users:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": "not the target's"}]
    return Conversation(cid, msgs)


def _encode(messages: list[dict]) -> list[int]:
    return [len(w) for m in messages for w in m["content"].split()]


def _drain(q: TurnQueue, answer=lambda t: f"answer {t.id} {t.dialogue.sample} {t.turn}") -> list:
    asked = []
    while (t := q.pop()) is not None:
        asked.append(t)
        q.answered(t, answer(t))
    return asked


def test_later_turns_follow_the_targets_own_answers():
    convs = iter([_conv("a", "one", "two words", "three", system="be brief"), _conv("b", "x y")])
    q = TurnQueue(convs, _encode, 100, conversations=5, turns=2)
    asked = _drain(q)
    assert [t.key for t in asked] == [("a", 0, 1), ("a", 0, 2), ("b", 0, 1)]  # a follow-up goes first
    second = asked[1]
    assert second.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "answer a 0 1"},
        {"role": "user", "content": "two words"},
    ]
    assert second.prompt_ids == _encode(second.messages) and q.taken == 2
    assert [t.key for t in _drain(TurnQueue(iter([_conv("a", "1", "2", "3")]), _encode, 100, 9, turns=0))] == [
        ("a", 0, 1),
        ("a", 0, 2),
        ("a", 0, 3),
    ]


def test_samples_are_dialogues_of_their_own_with_their_own_seeds():
    q = TurnQueue(iter([_conv("a", "u1", "u2")]), _encode, 100, conversations=1, turns=2, samples=3, seed=7)
    asked = _drain(q, answer=lambda t: f"s{t.dialogue.sample}")
    assert sorted(t.key for t in asked) == [("a", s, k) for s in range(3) for k in (1, 2)]
    assert {t.dialogue.sample: t.seed for t in asked} == {0: 7, 1: 8, 2: 9}
    for t in asked:
        if t.turn == 2:
            assert t.messages[1]["content"] == f"s{t.dialogue.sample}"  # its own first answer, not another sample's


def test_the_prompt_limit_skips_conversations_and_ends_dialogues():
    long_first = _conv("long", "a b c d e f")
    grows = _conv("grows", "a", "b c d")
    q = TurnQueue(iter([long_first, grows, _conv("c", "z")]), _encode, 5, conversations=2, turns=0)
    asked = _drain(q, answer=lambda t: "w w w")
    # 'long' is skipped (not counted); 'grows' turn 2 would need 1 + 3 + 3 = 7 > 5 tokens: it ends there
    assert [t.key for t in asked] == [("grows", 0, 1), ("c", 0, 1)]


def test_resume_asks_only_the_missing_turns_after_the_recorded_answers():
    done_rec = {
        "id": "a",
        "sample": 1,
        "turn": 1,
        "conversations": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "kept answer"}],
    }
    old = {"id": "b", "conversations": [{"role": "user", "content": "v"}, {"role": "assistant", "content": "x"}]}
    done = {record_key(done_rec): done_rec, record_key(old): old}
    assert record_key(old) == ("b", 0, 1)
    q = TurnQueue(
        iter([_conv("a", "u1", "u2"), _conv("b", "v")]), _encode, 100, 2, turns=2, samples=2, seed=0, done=done
    )
    asked = _drain(q)
    assert sorted(t.key for t in asked) == [("a", 0, 1), ("a", 0, 2), ("a", 1, 2), ("b", 1, 1)]
    resumed = next(t for t in asked if t.key == ("a", 1, 2))
    assert resumed.messages[1] == {"role": "assistant", "content": "kept answer"}


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="turns >= 0 and samples >= 1"):
        TurnQueue(iter([]), _encode, 10, 1, samples=0)
