"""The [LIFECYCLE] parser is forgiving and total; the stream filter never leaks a block."""

from hypothesis import given, settings
from hypothesis import strategies as st

from clm_middleware.lifecycle.protocol import parse_block, split_reply
from clm_middleware.lifecycle.reply_filter import ReplyFilter, visible_answer
from clm_middleware.lifecycle.segments import Label

VALID = {f"seg_{i}" for i in range(6)}


def test_well_formed_block_gives_labels_and_the_answer_before_it():
    output = "Here you go.\n[LIFECYCLE]\nseg_1: keep\nseg_2: drop\nseg_3: compress\n[/LIFECYCLE]"
    parsed = parse_block(output, VALID)
    assert parsed.ok and parsed.closed
    assert parsed.labels == {"seg_1": Label.KEEP, "seg_2": Label.DROP, "seg_3": Label.COMPRESS}
    assert split_reply(output)[0] == "Here you go."


def test_unknown_ids_are_ignored_and_repeated_ids_take_the_last_value():
    parsed = parse_block("[LIFECYCLE]\nseg_99: drop\nseg_2: drop\nseg_2: keep\n[/LIFECYCLE]", VALID)
    assert parsed.labels == {"seg_2": Label.KEEP}
    assert parsed.ignored == ("seg_99",)


def test_variants_of_the_line_format_are_understood():
    output = "[lifecycle]\n- seg 1 - KEEP\n* seg_2 = drop\nsegment 3: **compress**\n"
    parsed = parse_block(output, VALID)
    assert parsed.labels == {"seg_1": Label.KEEP, "seg_2": Label.DROP, "seg_3": Label.COMPRESS}
    assert not parsed.closed  # a missing closing tag is tolerated


def test_garbage_block_is_found_but_not_ok_and_no_block_is_not_found():
    garbage = parse_block("answer [LIFECYCLE] I think everything matters", VALID)
    assert garbage.found and not garbage.ok
    absent = parse_block("just an answer", VALID)
    assert not absent.found and not absent.ok


def test_the_last_block_wins_over_an_earlier_quoted_one():
    output = "You wrote [LIFECYCLE] seg_1: drop [/LIFECYCLE] earlier.\n[LIFECYCLE]\nseg_1: keep\n[/LIFECYCLE]"
    assert parse_block(output, VALID).labels == {"seg_1": Label.KEEP}


block_lines = st.lists(
    st.one_of(
        st.builds(
            lambda i, label: f"seg_{i}: {label}",
            st.integers(-3, 40),
            st.sampled_from(["keep", "drop", "compress", "KEEP", "zap"]),
        ),
        st.text(max_size=40),
        st.just("[/LIFECYCLE]"),
        st.just("[LIFECYCLE]"),
    ),
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(prefix=st.text(max_size=60), lines=block_lines, opened=st.booleans())
def test_parser_never_raises_and_never_yields_an_id_outside_the_context(prefix, lines, opened):
    output = prefix + ("\n[LIFECYCLE]\n" if opened else "\n") + "\n".join(lines)
    parsed = parse_block(output, VALID)
    assert set(parsed.labels) <= VALID
    assert all(isinstance(label, Label) for label in parsed.labels.values())


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_parser_is_total_on_arbitrary_text(text):
    parsed = parse_block(text, VALID)
    assert set(parsed.labels) <= VALID


@settings(max_examples=200, deadline=None)
@given(
    answer=st.text(st.characters(blacklist_characters="["), max_size=80),
    block=st.sampled_from(
        [
            "",
            "\n[LIFECYCLE]\nseg_1: drop\n[/LIFECYCLE]",
            " [Lifecycle]\nseg_2: keep",
            "\n[ LIFECYCLE ]",
        ]
    ),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    stops=st.lists(st.sampled_from(["STOP", "###", "\n\n"]), max_size=2),
)
def test_streamed_text_equals_the_final_answer_and_never_shows_the_block(answer, block, cuts, stops):
    raw = answer + block
    points = sorted({min(c, len(raw)) for c in cuts} | {len(raw)})
    stream = ReplyFilter(stops=stops)
    shown = "".join(stream.delta(raw[:point]) for point in points)
    final = visible_answer(raw, stops=stops)
    shown += stream.finish(final)
    assert shown == final
    assert "[LIFECYCLE]" not in shown.upper().replace(" ", "")


def test_the_answer_keeps_its_trailing_whitespace_unless_something_was_cut_after_it():
    """As OpenAI, vLLM and llama.cpp return it: the text before a stop string, or all of
    it; a cut of this library's (block, marker, repeat) takes the whitespace before it."""
    assert visible_answer("The capital of France", stops=["France"]) == "The capital of "
    assert visible_answer("1. Banana\n2. Apple", stops=["2."]) == "1. Banana\n"
    assert visible_answer("Sure!\n\n", stops=()) == "Sure!\n\n"
    assert visible_answer("Sure!\n[LIFECYCLE]\nseg_1: drop\n[/LIFECYCLE]", stops=()) == "Sure!"
    assert visible_answer("Hello there\n[seg_3]", stops=()) == "Hello there"
    looping = "I'm glad to help. I'm glad to help. "
    assert visible_answer(looping, stops=(), cut_repeats=True) == "I'm glad to help."
