"""Distinctive tokens: what a compression must keep verbatim and may not invent."""

import pytest

from clm_middleware.lifecycle.distinctive import distinctive_tokens


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The booking reference is QX7-4821, flight TP1357 at 10:40.", {"qx7-4821", "tp1357", "10:40"}),
        ("I leave at 6:20 am on the 14th of this month.", {"6:20 am", "14th of this month"}),
        ("It costs $121, or 2,400 euros in total.", {"$121", "2,400 euros"}),
        ("We meet on April 22 and again on 3rd of May.", {"april 22", "3rd of may"}),
        ("Write to jo.smith@example.com today.", {"jo.smith@example.com"}),
        ("I found Casa do Jardim near Príncipe Real.", {"casa do jardim", "príncipe real"}),
        ("Try the Abbey Court Hotel (Hyde Park) tonight.", {"abbey court hotel (hyde park"}),
        ("My doctor is Dr. Okafor.", {"dr. okafor"}),
        ("New York is big.", {"new york"}),
        ("Thanks, that sounds lovely.", set()),
    ],
)
def test_detects_numbers_codes_times_dates_amounts_emails_and_names(text, expected):
    assert distinctive_tokens(text) == expected


def test_a_capitalised_word_opening_a_sentence_is_grammar_not_a_name():
    assert distinctive_tokens("Tomorrow works. Please call Maria.") == {"maria"}


def test_arbitrary_text_never_breaks_detection():
    for text in ("", "A", "I", "Dr.", "( )", "The", "X Y", "Mr. X", "1st", "Ĳ"):
        assert isinstance(distinctive_tokens(text), set)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Your number is KGRZSK8S. Can I help you further?", {"kgrzsk8s"}),
        ("Glad I could help. Bye!", set()),
        ("Oh, and I Paris too.", {"paris"}),
        ("Thanks Maria, see you.", {"maria"}),
        ("Great, I booked the Cambridge Punter for you.", {"cambridge punter"}),
    ],
)
def test_common_words_at_the_ends_of_a_capitalised_run_are_not_names(text, expected):
    assert distinctive_tokens(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I'll check in on the 4th of this month.", {"4th of this month"}),
        ("leaving next tuesday morning", {"next tuesday"}),
        ("Let's say Friday next week.", {"friday next week"}),
        ("i can come on saturday", {"saturday"}),
    ],
)
def test_weekdays_and_relative_dates_are_dates_in_any_case(text, expected):
    assert distinctive_tokens(text) == expected
