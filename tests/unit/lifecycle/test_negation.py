"""A word-deleting compression never keeps what a negation governs without the negation."""

import pytest

from clm_middleware.lifecycle.compressor import is_function_word
from clm_middleware.lifecycle.negation import has_negation, is_negator, negation_scopes, with_negations


def _words(text: str) -> list[str]:
    return text.split()


def _kept(text: str, keep: set[str]) -> str:
    words = _words(text)
    chosen = with_negations(words, {i for i, w in enumerate(words) if w in keep}, is_function_word)
    return " ".join(words[i] for i in sorted(chosen))


@pytest.mark.parametrize("word", ["not", "Never", "no", "don't", "Can’t", "isn't", "without", "cannot", "won't,"])
def test_negators_are_recognised_in_any_case_and_apostrophe(word):
    assert is_negator(word)


@pytest.mark.parametrize("word", ["note", "know", "nothingness", "done", "wonder", "cant-lever"])
def test_words_that_only_look_like_negators_are_not(word):
    assert not is_negator(word)


def test_a_scope_runs_to_the_end_of_its_clause_or_a_but():
    assert negation_scopes(_words("I'm not available on Tuesday, but Thursday works.")) == [([1], [2, 3, 4])]
    assert negation_scopes(_words("not today but tomorrow")) == [([0], [1])]
    assert negation_scopes(_words("I no longer take it.")) == [([1, 2], [3, 4])]  # "no longer" is one negator


@pytest.mark.parametrize(
    ("text", "keep", "expected"),
    [
        (
            "I'm not available on Tuesday, but Thursday works.",
            {"Tuesday,", "Thursday"},
            "not available on Tuesday, Thursday",
        ),
        ("6 pm is fine. Don't call me, text only.", {"6", "pm", "call", "text"}, "6 pm Don't call me, text"),
        (
            "I no longer take lisinopril, now it's amlodipine 5 mg.",
            {"lisinopril,", "amlodipine", "5"},
            "no longer take lisinopril, amlodipine 5",
        ),
        (
            "Don't book anything before 10 am, my son has physio.",
            {"10", "am,", "physio."},
            "Don't book anything before 10 am, physio.",
        ),
        ("Priya is allergic, so never anything with nuts.", {"Priya", "never"}, "Priya never anything with nuts."),
        ("Chicken is still a no for me though.", {"Chicken"}, "Chicken"),  # nothing negated is kept: nothing added
    ],
)
def test_a_kept_word_of_a_negated_clause_brings_the_negation_and_what_it_negates(text, keep, expected):
    assert _kept(text, keep) == expected


def test_a_long_negated_clause_brings_only_its_first_content_words():
    text = "The service does not start when the configuration file under the etc directory has a typo."
    assert _kept(text, {"typo."}) == "not start configuration file typo."


def test_has_negation():
    assert has_negation("I do not want it") and not has_negation("I want it")


@pytest.mark.parametrize(
    ("text", "keep", "expected"),
    [
        ("Não quero refrigerante para as crianças, só suco natural.", {"refrigerante"}, "Não quero refrigerante"),
        ("Ich möchte keine Nüsse im Essen, danke.", {"Nüsse"}, "keine Nüsse"),
        ("Quiero la pizza sin gluten por favor.", {"gluten"}, "sin gluten"),
    ],
)
def test_a_negator_of_another_common_language_is_carried_like_an_english_one(text, keep, expected):
    assert expected in _kept(text, keep)  # before, "quero refrigerante" said the opposite
