import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.segmenter import Segmenter, is_ack


def split(text, role="user", **kwargs):
    return [(p.kind, p.text) for p in Segmenter(**kwargs).split(text, role)]


def test_sentences_become_segments_and_questions_are_marked():
    assert split("I fly on April 22 with TAP. Can you book a hotel near the river?") == [
        ("text", "I fly on April 22 with TAP."),
        ("question", "Can you book a hotel near the river?"),
    ]


def test_chinese_and_japanese_sentences_end_at_full_width_marks_without_a_space():
    chinese = "我叫王小明，上个月在你们网站买了咖啡机。我的订单号是DD-20250318-7741！你能帮我查一下物流现在到哪里了吗？"
    assert split(chinese) == [
        ("text", "我叫王小明，上个月在你们网站买了咖啡机。"),
        ("text", "我的订单号是DD-20250318-7741！"),
        ("question", "你能帮我查一下物流现在到哪里了吗？"),
    ]
    short = "予約は3月5日です。「はい」と言いました。"  # short sentences join as written, with no space
    assert "".join(text for _, text in split(short)) == short


def test_paragraphs_numbered_steps_and_code_blocks():
    text = (
        "Do this:\n\n1. Install the package.\n2. Run the tests.\n\n```python\nx = 1\n\ny = 2\n```\nThat is all for now."
    )
    assert split(text) == [
        ("text", "Do this:"),
        ("step", "1. Install the package."),
        ("step", "2. Run the tests."),
        ("code", "```python\nx = 1\n\ny = 2\n```"),
        ("text", "That is all for now."),
    ]


def test_list_items_after_the_line_that_introduces_them_are_steps_with_their_numbers():
    text = "My checklist for the migration tonight, call ext. 4417\n1. Run m_0042.sql\n2. Verify 1,204,877 rows"
    assert split(text) == [
        ("text", "My checklist for the migration tonight, call ext. 4417"),
        ("step", "1. Run m_0042.sql"),
        ("step", "2. Verify 1,204,877 rows"),
    ]
    # a line that is no item after the first item: not a list, sentences as before
    assert [kind for kind, _ in split("Some intro text here.\n- first item\nnot an item at all\n- second")] == ["text"]


def test_a_tilde_fence_is_one_code_segment():
    text = "Apply this manifest, please.\n~~~yaml\nresources:\n  limits:\n    cpu: 500m\n~~~"
    assert split(text) == [
        ("text", "Apply this manifest, please."),
        ("code", "~~~yaml\nresources:\n  limits:\n    cpu: 500m\n~~~"),
    ]


def test_an_abbreviated_month_or_extension_before_a_number_ends_no_sentence():
    assert split("The launch is Jan. 5, 2025 and the audit follows.") == [
        ("text", "The launch is Jan. 5, 2025 and the audit follows.")
    ]
    assert split("Call me at (415) 555-0132, ext. 209. I am in the office all day.") == [
        ("text", "Call me at (415) 555-0132, ext. 209."),
        ("text", "I am in the office all day."),
    ]
    # before a capital it is a sentence end like any other
    assert split("We finally moved to Porto in Sept. It was colder than we expected there.") == [
        ("text", "We finally moved to Porto in Sept."),
        ("text", "It was colder than we expected there."),
    ]


def test_tiny_fragments_join_a_neighbour_and_abbreviations_do_not_split():
    assert split("Hi! I need help with my booking today.") == [("text", "Hi! I need help with my booking today.")]
    assert split("Dr. Smith moved the meeting. It is now on Friday.") == [
        ("text", "Dr. Smith moved the meeting."),
        ("text", "It is now on Friday."),
    ]


def test_content_free_messages_are_one_ack_segment():
    for text in ("ok thanks", "Thanks!", "cool", "You're welcome.", "ok great"):
        assert split(text) == [("ack", text)], text
    assert not is_ack("ok, order 42 then")
    assert not is_ack("yes")  # an answer, not an acknowledgement


def test_system_tool_and_assistant_messages_are_one_segment():
    assert split("Line one. Line two.", role="system") == [("system", "Line one. Line two.")]
    assert split('{"status": "ok"}', role="tool") == [("tool", '{"status": "ok"}')]
    assert split("Sure. Here it is.", role="assistant") == [("reply", "Sure. Here it is.")]


def test_user_rules_decide_the_kind_first():
    segmenter = Segmenter()
    segmenter.add_rule(r"(?i)\border\s+\d+", "order")
    assert [p.kind for p in segmenter.split("Order 4411 is late again. Why is that happening?", "user")] == [
        "order",
        "question",
    ]
    with pytest.raises(ConfigError, match="pattern"):
        segmenter.add_rule("(", "x")
    with pytest.raises(ConfigError, match="kind"):
        segmenter.add_rule("x", "not a kind")


def test_normalisation_folds_full_width_characters_and_spaces():
    segmenter = Segmenter(normalize=True)
    assert segmenter.normalise_text("ＡＢＣ１２３   ok\u3000now") == "ABC123 ok now"
    assert Segmenter().normalise_text("ＡＢＣ") == "ＡＢＣ"


WHITESPACE_CASES = [
    "1. Pack\n   - passport\n   - charger\n2. Travel\n   - taxi",  # a nested list
    "    return x * 2\nwhy does it double?",  # indentation on the first line
    "First line.\r\nSecond line here.\r\n\r\nThird paragraph.",  # CRLF
    "Title.\n\n\n\nBody of the note.",  # more than one blank line
    "Hello   there.    How   are you doing today?",  # runs of spaces
    "\nStarts with a newline. Then more text.",
    "Question here?\n\n\n",  # trailing whitespace
    "Steps:\n \n- one\n\t- two",  # a blank line with a space in it; a tab
]


@pytest.mark.parametrize("text", WHITESPACE_CASES)
@pytest.mark.parametrize("role", ["user", "system", "assistant", "tool"])
def test_separators_and_texts_joined_give_the_message_back_exactly(text, role):
    pieces = Segmenter().split(text, role)
    assert "".join(p.separator + p.text for p in pieces) == text
    assert all(not p.separator.strip() for p in pieces)  # separators are whitespace only


def test_a_message_of_whitespace_only_has_no_segments():
    for role in ("user", "system", "assistant", "tool"):
        assert Segmenter().split(" \n\t ", role) == []


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab .\t\n", max_size=40))
def test_paragraphs_are_the_runs_without_a_paragraph_break(text):
    """The linear split equals the per-character look-ahead it replaced (which raised
    MemoryError on an 8 MB message)."""
    import regex

    from clm_middleware.lifecycle.segmenter import _paragraphs

    expected = [(m.start(), m.group()) for m in regex.finditer(r"(?s)(?:(?!\n[ \t]*\n).)+", text)]
    assert _paragraphs(text) == expected
