"""The words that frame a long message: its opening instruction, its closing question."""

from __future__ import annotations

import pytest

from clm_middleware.lifecycle.compressor import _WORD
from clm_middleware.lifecycle.framing import FRAME_WORDS, framing_words

PASTE = " ".join(["engine paper river stone garden"] * 20)  # 100 words, no punctuation


def framed(text: str) -> list[str]:
    words = list(_WORD.finditer(text))
    return [words[i].group() for i in sorted(framing_words(text, words))]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"What is the most common word? {PASTE}", ["What", "is", "the", "most", "common", "word?"]),
        (f"Summarize this text: {PASTE}", ["Summarize", "this", "text:"]),
        (f"Here is my log.\n{PASTE}", ["Here", "is", "my", "log."]),
        # a question typed after a paste with no full stop between: from its capital on
        (f"{PASTE} Which word comes up most often?", ["Which", "word", "comes", "up", "most", "often?"]),
        (f"{PASTE}.\nwhich word comes up most often?", ["which", "word", "comes", "up", "most", "often?"]),
    ],
)
def test_the_opening_instruction_and_the_closing_question_frame_a_paste(text, expected):
    assert framed(text) == expected


def test_an_opening_clause_longer_than_the_frame_frames_nothing_and_a_statement_has_no_closing_question():
    assert framed(f"{PASTE}. The end.") == []
    long_question = f"{PASTE} and then some more?"
    assert len(framed(long_question)) == FRAME_WORDS  # its last words: where a question asks
