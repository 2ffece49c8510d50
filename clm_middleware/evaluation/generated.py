"""What the conversation generators share: facts, sentence decks, and the weaving of a session.

A generator (``chitchat``, ``support``) supplies facts and filler; ``weave`` lays them out:

    turn 0 ............ 55% ...... 60% ............................ end
    | facts stated here |          | recall questions here           |

- every fact is stated exactly once, inside an ordinary multi-sentence message (never as
  a message of its own), by the speaker the fact belongs to;
- its recall question comes at least ``min_gap`` user turns later, and the reply to it
  does not give the answer, so the answer lives in exactly one message of the session;
- between them: filler small talk from the generator, and session breaks (a header such
  as "Session 2 — a week later") at seeded points.

``weave`` checks the "exactly one message" invariant and raises ``RuntimeError`` if the
vocabularies ever let an answer leak into filler: a generator bug, not a user error.
Everything is drawn from one ``random.Random``, so a seed gives the same session.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from clm_middleware.evaluation.probes import Probe
from clm_middleware.evaluation.sessions import Session

T = TypeVar("T")
FACTS_SHARE = 0.55  # facts are stated in the first 55% of the user turns ...
RECALL_SHARE = 0.6  # ... and asked back in the last 40%


@dataclass(frozen=True, slots=True)
class Fact:
    """One planted fact: how it is said, asked back in the chat, and asked as a probe."""

    key: str  # its category; unique within a session
    statement: str  # the sentence that states it, woven into a longer message
    recall: str  # how the other speaker is asked about it later, without the answer
    question: str  # the probe question, asked after the session
    answer: str
    alternatives: tuple[str, ...] = ()
    speaker: str = "user"  # "user" or "assistant": who states it

    def probe(self) -> Probe:
        return Probe(self.question, self.answer, self.alternatives)


class Deck(Generic[T]):
    """Draws items in a shuffled order, reshuffling only when all were used: no item
    repeats before every other item came once (filler reads less canned that way)."""

    __slots__ = ("_items", "_left", "_rng")

    def __init__(self, rng: random.Random, items: Sequence[T]) -> None:
        if not items:
            raise ValueError("items: a deck needs at least one item")
        self._rng, self._items = rng, list(items)
        self._left: list[T] = []

    def draw(self) -> T:
        if not self._left:
            self._left = self._rng.sample(self._items, len(self._items))
        return self._left.pop()

    def take(self, count: int) -> list[T]:
        return [self.draw() for _ in range(count)]


@dataclass(frozen=True, slots=True)
class Script:
    """What a generator supplies to ``weave``; every callable draws from the shared rng."""

    facts: list[Fact]
    exchange: Callable[[], tuple[str, str]]  # one filler (user, assistant) exchange
    embed: Callable[[str, str], str]  # (fact sentence, speaker) -> a long message of that speaker around it
    reply: Callable[[], str]  # the assistant's reply to a user message that states a fact
    recall_reply: Callable[[], str]  # a reply to a recall question that does not answer it
    session_header: Callable[[int], str]  # the line that opens session n (1, 2, ...); "" for none
    system: str | None = None


def weave(rng: random.Random, script: Script, *, user_turns: int, sessions: int, min_gap: int) -> Session:
    """Lay out ``script`` over ``user_turns`` user turns in ``sessions`` sessions (see the module doc)."""
    facts = script.facts
    fact_end, recall_start = int(user_turns * FACTS_SHARE), int(user_turns * RECALL_SHARE)
    if len(facts) > fact_end - 1 or len(facts) > user_turns - recall_start:
        raise ValueError(f"turns: {user_turns} user turns are too few for {len(facts)} facts")
    fact_turns = sorted(rng.sample(range(1, fact_end), len(facts)))
    recall_turns = _recall_turns(rng, fact_turns, recall_start, user_turns, min_gap)
    breaks = _session_starts(rng, user_turns, sessions)
    stated = dict(zip(fact_turns, facts, strict=True))
    asked = dict(zip(recall_turns, facts, strict=True))
    messages: list[dict[str, str]] = [{"role": "system", "content": script.system}] if script.system else []
    fact_message: dict[str, int] = {}
    session = 0
    for turn in range(user_turns):
        header = ""
        if turn in breaks:
            session += 1
            header = script.session_header(session)
            header = header + "\n\n" if header else ""
        if turn in stated:
            fact = stated[turn]
            if fact.speaker == "user":
                user, assistant = script.embed(fact.statement, "user"), script.reply()
                fact_message[fact.key] = len(messages)
            else:
                user, assistant = script.exchange()[0], script.embed(fact.statement, "assistant")
                fact_message[fact.key] = len(messages) + 1
        elif turn in asked:
            user, assistant = asked[turn].recall, script.recall_reply()
        else:
            user, assistant = script.exchange()
        messages += [{"role": "user", "content": header + user}, {"role": "assistant", "content": assistant}]
    _check_once(messages, facts, fact_message)
    return Session(messages, [fact.probe() for fact in facts])


def _session_starts(rng: random.Random, user_turns: int, sessions: int) -> set[int]:
    """Turn 0, then ``sessions - 1`` starts near even spacing (jittered by a quarter session)."""
    if not 1 <= sessions <= max(1, user_turns // 8):
        raise ValueError(f"sessions: between 1 and {max(1, user_turns // 8)} for {user_turns} turns")
    length = user_turns / sessions
    jitter = int(length / 4)
    return {0} | {round(k * length) + rng.randint(-jitter, jitter) for k in range(1, sessions)}


def _recall_turns(rng: random.Random, fact_turns: list[int], start: int, end: int, min_gap: int) -> list[int]:
    """A distinct recall turn per fact, each ≥ ``min_gap`` after its fact and in [start, end)."""
    free = list(range(start, end))
    chosen: dict[int, int] = {}
    # Latest fact first: its options are a subset of every earlier fact's, so a random pick
    # for it can never take the last slot an earlier fact needed.
    for fact_turn in sorted(fact_turns, reverse=True):
        options = [t for t in free if t - fact_turn >= min_gap]
        if not options:
            raise ValueError(f"turns: no room to ask about the fact of turn {fact_turn} {min_gap} turns later")
        chosen[fact_turn] = rng.choice(options)
        free.remove(chosen[fact_turn])
    return [chosen[t] for t in fact_turns]


def _check_once(messages: list[dict[str, str]], facts: list[Fact], fact_message: dict[str, int]) -> None:
    for fact in facts:
        holders = [i for i, m in enumerate(messages) if fact.probe().retained_in(m["content"])]
        if holders != [fact_message[fact.key]]:
            raise RuntimeError(f"fact {fact.key!r} ({fact.answer!r}) occurs in messages {holders}, not only its own")


def ordinal_date(month: str, day: int) -> tuple[str, tuple[str, ...]]:
    """``("March 14", ("March 14th", "14 March", "14th of March"))``: a date and how else it is written."""
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{month} {day}", (f"{month} {day}{suffix}", f"{day} {month}", f"{day}{suffix} of {month}")


def sentences(rng: random.Random, deck: Deck, low: int, high: int) -> list[str]:
    return deck.take(rng.randint(low, high))


def join(parts: Sequence[str]) -> str:
    """Sentences joined by a space; a part after a multi-line one (a numbered list) starts a new line."""
    kept = [p.strip() for p in parts if p.strip()]
    text = kept[0] if kept else ""
    for previous, part in itertools.pairwise(kept):
        text += ("\n" if "\n" in previous else " ") + part
    return text
