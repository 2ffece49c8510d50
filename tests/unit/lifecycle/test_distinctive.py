"""Distinctive tokens: what a compression must keep verbatim and may not invent."""

import gc
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
        # in Chinese or Japanese a code ends where the script changes (it had taken the whole
        # clause: "我的订单号是dd-20250318-7741"), and dates and amounts are written their way
        ("我的订单号是DD-20250318-7741，电话138-0013-8000。", {"dd-20250318-7741", "138-0013-8000"}),
        ("是2025年3月18日下的单，共2380元，航班CA1234。", {"2025年3月18日", "2380元", "ca1234"}),
        # a date with another language's month keeps its month (tightening had left "१५ २०२५")
        ("Die Lieferung kam am 3. Mai 2025.", {"die lieferung", "3. mai 2025"}),
        ("Оплата 15 апреля 2025 года.", {"15 апреля 2025"}),
        ("Llego el 3 de mayo de 2025.", {"3 de mayo de 2025"}),
        ("बुकिंग १५ अप्रैल २०२५ की है", {"१५ अप्रैल २०२५"}),
        ("Mars is red, and mayo is a sauce.", set()),
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


# Long runs of one shape are what made the old patterns backtrack (cubic in the run's
# length for letters with no digit): 20k characters took hours; linear takes milliseconds.
RUN_PIECES = [
    "a",
    "A",
    "1",
    "-",
    "_",
    "/",
    ".",
    ",",
    "@",
    " ",
    "Mr. ",
    "of ",
    "ACGT",
    "é",
    "9am",
    ":",
    ";",
    "|",
    "\\",
    "~",
    "()",
    "'",
    "€",
    "R$",
    "CHF ",
    "ext ",
]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(RUN_PIECES), min_size=1, max_size=3), st.integers(2_000, 20_000))
def test_distinctive_tokens_take_bounded_time_on_long_runs(pieces, length):
    text = ("".join(pieces) * (length // len("".join(pieces)) + 1))[:length]
    # the faster of two runs, with the collector paused: a backtracking pattern is slow every
    # time, while a full collection of the suite's heap or a busy machine is slow once
    timings = []
    gc.disable()
    try:
        for _ in range(2):
            started = time.perf_counter()
            distinctive_tokens(text)
            timings.append(time.perf_counter() - started)
    finally:
        gc.enable()
    assert min(timings) < 2.0  # linear: ~0.01 s per 10k characters here


@pytest.mark.parametrize(
    ("text", "amount"),
    [
        ("The price is ₪ 249.90 now.", "₪ 249.90"),
        ("It costs R$ 1.500,00 in total.", "r$ 1.500,00"),
        ("Rent is CHF 2'450.50 per month.", "chf 2'450.50"),
        ("Pay €1.234,56 by Friday.", "€1.234,56"),
        ("It was 12 € each.", "12 €"),
        ("A fee of 1.234,56 EUR applies.", "1.234,56 eur"),
        ("Call (415) 555-0132, ext. 209 after lunch.", "ext. 209"),
    ],
)
def test_a_currency_or_an_extension_stays_with_its_number(text, amount):
    # "₪ 249.90" condensed to "249.90" says another amount; "ext. 209" to "209" reads as
    # part of the phone number
    assert amount in distinctive_tokens(text)


def test_a_word_that_is_also_a_currency_code_elsewhere_is_no_amount():
    assert distinctive_tokens("I will try 2 more times, then rub 3 drops in.") == {"2", "3"}


def test_the_dos_fix_keeps_codes_that_start_mid_text():
    assert distinctive_tokens("ref abc-12, x/7 and a-b-c-9; mail a.b+c@ex-ample.org") == {
        "abc-12",
        "x/7",
        "a-b-c-9",
        "a.b+c@ex-ample.org",
    }


@pytest.mark.parametrize(
    ("text", "literal"),
    [
        ("ModuleNotFoundError: No module named 'yaml' when I run it", "yaml"),
        ('open "config.json" first', "config.json"),
        ("then run `pip install -e .` again", "`pip install -e .`"),
    ],
)
def test_a_quoted_identifier_or_backticked_text_is_distinctive(text, literal):
    assert literal in distinctive_tokens(text)


@pytest.mark.parametrize("text", ["I don't know, it's the user's call", 'He said "I will come" later'])
def test_apostrophes_and_quoted_sentences_are_not_literals(text):
    assert distinctive_tokens(text) == set()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'Traceback:\n  File "/home/dana/etl/loader.py", line 14, in parse_row',
            {"/home/dana/etl/loader.py", "14", "parse_row"},
        ),
        ("The CSV header is: id;date;Amount;currency .", {"csv", "id;date;amount;currency"}),
        ("Do I need to tell csv.DictReader that?", {"csv.dictreader"}),
        ("Edit src/utils/io.py, then run ~/bin/deploy.sh", {"src/utils/io.py", "~/bin/deploy.sh"}),
        ("It is in C:\\Users\\ana\\notes.txt", {"c:\\users\\ana\\notes.txt"}),
        ("ValueError again, from parseRow in loader.py", {"valueerror", "parserow", "loader.py"}),
    ],
)
def test_paths_files_and_identifiers_that_code_names_are_distinctive(text, expected):
    assert distinctive_tokens(text) == expected


@pytest.mark.parametrize("text", ["e.g. this, i.e. that", "and/or in km/h", "it is what it is. Then go"])
def test_abbreviations_and_slashed_words_are_not_identifiers(text):
    assert distinctive_tokens(text) == set()
