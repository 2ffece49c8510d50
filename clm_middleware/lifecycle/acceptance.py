"""Which of the model's replies the user accepted.

A reply is accepted when the user's next message opens with an acceptance ("Yes,
that's right.", "That sounds good, can you ...", "Great. Book it.", "Hustlers sounds
great."): its first clause (up to the first . , ! ? ; or :) is made only of acceptance
and filler words and words of the reply itself (the user naming what they take),
holds at least one word that accepts, and no word that rejects ("no", "not", "wait",
"actually", "instead"). In a task dialogue such a reply is the agreed state: the
offer taken, the booking confirmed, in the assistant's words. It ranks above the
model's other replies when the budget forces a loss (see ``rules.eviction_value``).

Judged from the stored messages alone, so a reloaded conversation judges the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import regex

from clm_middleware.lifecycle.segmenter import casefolded_words
from clm_middleware.lifecycle.segments import MessageRecord

_CLAUSE_END = regex.compile(r"[.,!?;:\n…]")
_ACCEPTING_TEXT = """yes yeah yep yup ya sure ok okay k great perfect good fine correct right exactly works
    absolutely definitely alright awesome excellent wonderful nice cool lovely brilliant agreed
    deal thanks thank thx appreciate fantastic splendid ideal"""
_FILLER_TEXT = """that that's thats this it it's its is sounds sound looks look seems seem one a an the
    all so very really just much please you do does will would be i i'm me my we to with go
    let's lets like love book reserve confirm confirmed yes's one's oh well then both"""
_REJECTING_TEXT = "no nope nah not don't dont isn't wait actually instead but hmm"
ACCEPTING_WORDS = frozenset(_ACCEPTING_TEXT.split())
_FILLER_WORDS = frozenset(_FILLER_TEXT.split())
REJECTING_WORDS = frozenset(_REJECTING_TEXT.split())


@functools.lru_cache(maxsize=8192)  # asked again for the same pairs on every compaction
def opens_with_acceptance(text: str, reply: str = "") -> bool:
    """Whether a user message opens by accepting ``reply``, the message before it."""
    words = casefolded_words(_CLAUSE_END.split(text.strip(), maxsplit=1)[0])
    if not words or any(w in REJECTING_WORDS for w in words):
        return False
    named = set(casefolded_words(reply))
    if not all(w in ACCEPTING_WORDS or w in _FILLER_WORDS or w in named for w in words):
        return False
    return any(w in ACCEPTING_WORDS for w in words)


def accepted_replies(messages: Sequence[MessageRecord], among: Sequence[MessageRecord] | None = None) -> frozenset[int]:
    """Indices of the assistant messages that the next message, the user's, accepts.

    ``messages``: every message, each at the position of its ``index``; ``among``: the
    replies to judge (default: all), so a caller that knows which can still matter
    pays for those only."""
    replies = messages if among is None else among
    return frozenset(
        reply.index
        for reply in replies
        if reply.role == "assistant"
        and reply.index + 1 < len(messages)
        and messages[reply.index + 1].role == "user"
        and opens_with_acceptance(messages[reply.index + 1].content, reply.content)
    )
