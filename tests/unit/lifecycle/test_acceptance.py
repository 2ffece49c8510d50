"""Which replies the user accepted: the next user message opens with an acceptance."""

import pytest

from clm_middleware.lifecycle.acceptance import accepted_replies, opens_with_acceptance
from clm_middleware.lifecycle.segments import MessageRecord


@pytest.mark.parametrize(
    "answer",
    ["Yes, that's right.", "That sounds good, can you find me a bus?", "Great. I need the tickets.", "ok thanks"],
)
def test_an_opening_acceptance_accepts(answer):
    assert opens_with_acceptance(answer)


@pytest.mark.parametrize(
    "answer",
    [
        "No, play it in the living room.",
        "Wait, maybe I do want the insurance.",
        "What is the address?",
        "Actually, make it two.",
        "Not great, anything cheaper?",
        "",
    ],
)
def test_a_rejection_a_question_or_nothing_does_not_accept(answer):
    assert not opens_with_acceptance(answer)


def test_the_user_may_name_what_they_take_from_the_reply():
    reply = "There's Angel Has Fallen, Hustlers, and IT Chapter Two."
    assert opens_with_acceptance("Hustlers sounds great.", reply)
    assert not opens_with_acceptance("Hustlers sounds great.", "There's Joker and Parasite.")


def test_accepted_replies_are_the_assistant_messages_the_next_user_message_accepts():
    said = [
        ("system", "You book hotels."),
        ("user", "A hotel in Porto, please."),
        ("assistant", "How about Hotel Infante at $120?"),
        ("user", "Too expensive, anything else?"),
        ("assistant", "Casa do Rio at $85?"),
        ("user", "Perfect, book it."),
        ("assistant", "Booked Casa do Rio for May 3rd."),
        ("tool", "ok"),
    ]
    messages = [MessageRecord(index=i, role=role, content=text, turn=i // 2) for i, (role, text) in enumerate(said)]
    assert accepted_replies(messages) == frozenset({4})


def test_accepted_replies_among_judges_only_the_given_replies_against_their_next_message():
    said = [
        ("user", "A hotel in Porto, please."),
        ("assistant", "How about Hotel Infante at $120?"),
        ("user", "Perfect, book it."),
        ("assistant", "Casa do Rio at $85?"),
        ("user", "Great, that one."),
    ]
    messages = [MessageRecord(index=i, role=role, content=text, turn=i // 2) for i, (role, text) in enumerate(said)]
    assert accepted_replies(messages) == frozenset({1, 3})
    # the reply's neighbour is looked up in the whole history, not in ``among``
    assert accepted_replies(messages, among=[messages[3]]) == frozenset({3})
    assert accepted_replies(messages, among=[messages[1], messages[4]]) == frozenset({1})
