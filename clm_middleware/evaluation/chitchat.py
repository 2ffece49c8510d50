"""Persona chit-chat over several sessions: two people catching up, with facts said once in passing.

The user (one person, with a name) tells the assistant (a friend) about their life
across several sessions ("Session 2 — a week later"). Each fact (a pet's name, a job,
a trip, a birthday, a neighbour...) is one sentence inside an ordinary long message
of small talk; the friend's reply reacts to the small talk, not to the fact. Many turns
later the user quizzes the friend about it ("Bet you don't remember what our dog is
called."), and the friend stalls without answering, so the answer stays in exactly one
message (``generated.weave`` checks it). Probes ask about the user by name.
"""

from __future__ import annotations

import random

from clm_middleware.evaluation import chitchat_words as words
from clm_middleware.evaluation.generated import Deck, Fact, Script, join, ordinal_date, weave
from clm_middleware.evaluation.sessions import Session

DEFAULT_TURNS = 100  # user turns: 200 messages, ~7.5k tokens, under SmolLM2's 8,192 positions
DEFAULT_FACTS = 15
DEFAULT_SESSIONS = 4
SHORT_SHARE = 0.2  # share of filler exchanges that are one-liners, as real chats have


def chitchat_session(
    *, user_turns: int = DEFAULT_TURNS, facts: int = DEFAULT_FACTS, sessions: int = DEFAULT_SESSIONS, seed: int = 0
) -> Session:
    """A seeded chit-chat session with ``facts`` facts (at most one per category) and their probes."""
    if not 1 <= facts <= len(words.FACTS):
        raise ValueError(f"facts: between 1 and {len(words.FACTS)}")
    rng = random.Random(seed)
    user, partner = rng.choice(words.USER_NAMES), rng.choice(words.PARTNER_NAMES)
    chosen = [_fact(rng, entry, user) for entry in rng.sample(words.FACTS, facts)]
    decks = _Decks(rng, user)
    script = Script(
        facts=chosen,
        exchange=lambda: _exchange(rng, decks),
        embed=lambda statement, _speaker: _embed(rng, decks, statement),  # only the user states facts
        reply=lambda: _reply(rng, decks),
        recall_reply=decks.recall.draw,
        session_header=lambda n: _header(rng, n, partner),
        system=None,  # two friends talking: no assistant persona to announce
    )
    session = weave(rng, script, user_turns=user_turns, sessions=sessions, min_gap=max(10, user_turns // 4))
    origin = {"generator": "chitchat", "seed": seed, "turns": user_turns, "facts": facts, "sessions": sessions}
    return Session(session.messages, session.probes, origin=origin)


class _Decks:
    """One deck per sentence pool, so nothing repeats before its pool is used up."""

    def __init__(self, rng: random.Random, user: str) -> None:
        self.times, self.activities = Deck(rng, words.TIMES), Deck(rng, words.ACTIVITIES)
        self.reactions, self.thoughts = Deck(rng, words.REACTIONS), Deck(rng, words.THOUGHTS)
        self.questions = Deck(rng, words.QUESTIONS)
        self.responses = Deck(rng, [r.format(user=user) for r in words.RESPONSES])
        self.short, self.short_replies = Deck(rng, words.SHORT), Deck(rng, words.SHORT_REPLIES)
        self.recall = Deck(rng, words.RECALL_REPLIES)

    def anecdote(self) -> str:
        return f"{self.times.draw()} {self.activities.draw()}, {self.reactions.draw()}."


def _fact(rng: random.Random, entry: tuple, user: str) -> Fact:
    key, values, statements, recalls, question = entry
    value = rng.choice(values)
    alternatives: tuple[str, ...] = ()
    if key == "birthday":
        month, day = value.split()
        value, alternatives = ordinal_date(month, int(day))
    return Fact(
        key=key,
        statement=rng.choice(statements).format(v=value),
        recall=rng.choice(recalls),
        question=question.format(name=user),
        answer=value,
        alternatives=alternatives,
    )


def _long_message(rng: random.Random, decks: _Decks, parts: int) -> list[str]:
    """``parts`` sentences of small talk: anecdotes and passing thoughts, in a seeded mix."""
    return [decks.anecdote() if rng.random() < 0.5 else decks.thoughts.draw() for _ in range(parts)]


def _exchange(rng: random.Random, decks: _Decks) -> tuple[str, str]:
    if rng.random() < SHORT_SHARE:
        return decks.short.draw(), decks.short_replies.draw()
    user = _long_message(rng, decks, rng.choice((1, 2, 2, 3)))
    if rng.random() < 0.5:
        user.append(decks.questions.draw())
    return join(user), _reply(rng, decks)


def _reply(rng: random.Random, decks: _Decks) -> str:
    parts = [decks.responses.draw(), *_long_message(rng, decks, rng.choice((1, 1, 2)))]
    if rng.random() < 0.3:
        parts.append(decks.questions.draw())
    return join(parts)


def _embed(rng: random.Random, decks: _Decks, statement: str) -> str:
    """The fact sentence in the middle of a long message: never first, never alone."""
    before, after = _long_message(rng, decks, rng.randint(1, 2)), _long_message(rng, decks, rng.randint(1, 2))
    return join([*before, statement, *after])


def _header(rng: random.Random, number: int, partner: str) -> str:
    if number == 1:
        return f"Session 1 — Hey {partner}, it's so nice to finally catch up properly."
    return f"Session {number} — {rng.choice(words.GAPS)}. {rng.choice(words.GREETINGS).format(partner=partner)}"
