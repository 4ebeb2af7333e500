"""The prompts of `moa-serve distill`: each conversation's user turns answered in order by the target,
a later turn's context holding the target's own earlier answers, and `samples` independent dialogues
per conversation (sample s answers with seed + s).

    conversation c (user turns u1 u2), samples 2, turns 2:
        (c, s0):  [u1] -> a1      then  [u1 a1 u2] -> a2
        (c, s1):  [u1] -> a1'     then  [u1 a1' u2] -> a2'

A dialogue's next turn is asked once its previous answer is in (`answered`), so a batch holds turns of
many dialogues at once; a turn whose prompt exceeds max_prompt_tokens ends its dialogue. Records are
keyed (conversation id, sample, turn): a resumed run restores each dialogue's answers from its records
and asks only the turns still missing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .data import Conversation

Key = tuple[str, int, int]  # (conversation id, sample, turn 1..)


@dataclass
class Dialogue:
    cid: str
    sample: int
    seed: int | None
    head: list[dict]  # messages before the first user turn (a system prompt)
    users: list[dict]  # the user turns to answer, in order
    answers: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict]:
        """The prompt of turn `turn` (1-based): the head, then user / own answer pairs, ending with its user turn."""
        out = list(self.head)
        for i in range(turn - 1):
            out += [self.users[i], {"role": "assistant", "content": self.answers[i]}]
        return out + [self.users[turn - 1]]


@dataclass
class Turn:
    dialogue: Dialogue
    turn: int
    messages: list[dict]
    prompt_ids: list[int]

    @property
    def key(self) -> Key:
        return (self.dialogue.cid, self.dialogue.sample, self.turn)

    @property
    def id(self) -> str:
        return self.dialogue.cid

    @property
    def seed(self) -> int | None:
        return self.dialogue.seed


def record_key(rec: dict) -> Key:
    """A distill record's key (records without sample / turn are a first turn of sample 0)."""
    return (str(rec["id"]), int(rec.get("sample", 0)), int(rec.get("turn", 1)))


class TurnQueue:
    """Turns to answer: follow-up turns first (their dialogues are under way), then the first turns of
    new conversations, at most `conversations` of them taken from the source (resumed ones included)."""

    def __init__(
        self,
        source: Iterator[Conversation],
        encode: Callable[[list[dict]], list[int]],
        max_prompt_tokens: int,
        conversations: int,
        turns: int = 1,
        samples: int = 1,
        seed: int | None = None,
        done: dict[Key, dict] | None = None,
    ):
        """turns: user turns answered per conversation (0: all); done: records already written, by key."""
        if turns < 0 or samples < 1:
            raise ValueError(f"need turns >= 0 and samples >= 1, got {turns}, {samples}")
        self.source, self.encode, self.max_prompt_tokens = source, encode, max_prompt_tokens
        self.left, self.turns, self.samples, self.seed = conversations, turns, samples, seed
        self.done = done or {}
        self.ready: deque[Turn] = deque()
        self.taken = 0  # conversations taken from the source

    def pop(self) -> Turn | None:
        """The next turn to ask, or None when none is ready (more may come as answers arrive)."""
        while not self.ready and self.left > 0:
            conv = next(self.source, None)
            if conv is None:
                self.left = 0
                break
            self._start(conv)
        return self.ready.popleft() if self.ready else None

    def answered(self, turn: Turn, text: str) -> None:
        """turn's answer is in: queue its dialogue's next turn (first, ahead of new conversations)."""
        d = turn.dialogue
        d.answers.append(text)
        self._advance(d, front=True)

    def _start(self, conv: Conversation) -> None:
        first = next((i for i, m in enumerate(conv.messages) if m["role"] == "user"), None)
        if first is None:
            return
        users = [m for m in conv.messages[first:] if m["role"] == "user"]
        users = users[: self.turns or None]
        if len(self.encode(conv.messages[: first + 1])) > self.max_prompt_tokens:
            return  # (skipped: does not count toward the conversations asked for)
        self.left -= 1
        self.taken += 1
        for s in range(self.samples):
            seed = None if self.seed is None else self.seed + s
            d = Dialogue(conv.id, s, seed, conv.messages[:first], users)
            while (rec := self.done.get((conv.id, s, len(d.answers) + 1))) is not None:
                d.answers.append(rec["conversations"][-1]["content"])
                if len(d.answers) == len(users):
                    break
            self._advance(d, front=False)

    def _advance(self, d: Dialogue, front: bool) -> None:
        turn = len(d.answers) + 1
        if turn > len(d.users):
            return
        messages = d.messages(turn)
        ids = self.encode(messages)
        if len(ids) > self.max_prompt_tokens:
            return  # the context outgrew the prompt limit: the dialogue ends here
        t = Turn(d, turn, messages, ids)
        self.ready.appendleft(t) if front else self.ready.append(t)
