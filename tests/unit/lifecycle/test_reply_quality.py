"""No machinery in a reply, streamed or not; repetition loops are recognised and leave the context."""

from __future__ import annotations

import json
import time

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from clm_middleware.lifecycle.config import GenerationSettings
from clm_middleware.lifecycle.renderer import digest_lines
from clm_middleware.lifecycle.reply_filter import ReplyFilter, visible_answer
from clm_middleware.lifecycle.reply_quality import (
    first_repeated_sentence,
    is_repetition_loop,
    reads_back_notes,
    repeat_in_progress,
    repeated_ngram_share,
    reply_flags,
    strip_artifacts,
)

HOSTILE = [
    "1234567890\n[seg_3] 1234567890\n[seg_4] fine",
    "Sure [seg_12]thing. [/LIFECYCLE] Done.",
    "Booked.\nseg_3: keep\n- seg_4: drop\nAnything else?",
    "Look at [ SEG 7 ] and [lifecycle ] here",
    "[seg_1",  # cut off mid-marker
    "\n[seg_4]\n\nUse the tool.",
]


@pytest.mark.parametrize("raw", HOSTILE)
def test_no_marker_tag_or_block_line_survives_the_filter(raw):
    answer = visible_answer(raw, stops=())
    folded = answer.casefold()
    assert "seg_" not in folded and "lifecycle" not in folded and "seg 7" not in folded


@pytest.mark.parametrize(
    "raw", ["[seg_5]\nYou can call it.", "\n[seg_4] [seg_5]  You can call it.", "[/LIFECYCLE] You can call it."]
)
def test_a_reply_that_opens_with_machinery_starts_where_its_words_do(raw):
    assert visible_answer(raw, stops=()) == "You can call it."


def test_a_reply_the_model_opened_with_a_newline_keeps_it():
    assert visible_answer("\nYou can call it.", stops=()) == "\nYou can call it."


def test_ordinary_brackets_and_words_are_left_alone():
    text = "See note [1] and segment 3 of the course; seg is short for segment."
    assert strip_artifacts(text) == text


@pytest.mark.parametrize("raw", [*HOSTILE, "plain answer, no machinery at all", "ok [seg_2]"])
def test_a_stream_never_shows_machinery_and_adds_up_to_the_final_answer(raw):
    stream = ReplyFilter(stops=())
    shown = ""
    for end in range(1, len(raw) + 1):
        shown += stream.delta(raw[:end])
        assert "[seg" not in shown.casefold() and "seg_3:" not in shown
    final = visible_answer(raw, stops=())
    shown += stream.finish(final)
    assert shown == final


def test_greedy_loops_are_recognised_and_answers_are_not():
    assert is_repetition_loop("10:30am: " * 12)
    assert is_repetition_loop("2,400 euros: 2,400 euros: 2,400 euros: 2,400 euros: 2,400 euros:")
    assert not is_repetition_loop("Yes. Yes.")
    prose = (
        "The museum opens at ten, and the guided tour starts at eleven from the main hall. "
        "Tickets cost twelve euros; children under six enter for free."
    )
    assert not is_repetition_loop(prose) and repeated_ngram_share(prose) == 0.0


def test_reply_flags_name_what_went_wrong():
    assert reply_flags("[seg_4] Hello", "Hello") == ["protocol_artifact"]
    assert reply_flags("go " * 20, "go " * 20) == ["repetition_loop"]
    assert reply_flags("", "") == ["empty"]
    earlier = ["I'm sorry for the confusion. You can find it on the website of the booking service today."]
    again = "I'm sorry for the confusion. You can find it on the website of the booking service now."
    assert reply_flags(again, again, earlier) == ["repeats_earlier_reply"]
    assert reply_flags(again, again, ["Something else entirely, about trains and museums in Porto."]) == []
    assert reply_flags("Hello there.", "Hello there.") == []


CODE_REPLIES = [
    "Change the signature:\n\n```python\n# before\ndef fetch_all(self, query):\n    cur = self.conn.cursor()\n"
    "    return cur.fetchall()\n\n# after\ndef fetch_all(self, query, params=None):\n    cur = self.conn.cursor()\n"
    "    return cur.fetchall()\n```\n\nThat's it.",
    "```python\n@pytest.fixture\ndef client(tmp_path):\n    conn = sqlite3.connect(tmp_path / 'a.db')\n"
    "    yield conn\n\n@pytest.fixture\ndef db_conn(tmp_path):\n    conn = sqlite3.connect(tmp_path / 'a.db')\n"
    "    yield conn\n```",
    "```sql\nCREATE TABLE items (id INTEGER PRIMARY KEY, sku TEXT, qty INTEGER);\n"
    "CREATE TABLE warehouses (id INTEGER PRIMARY KEY, name TEXT);\n```",
    "Two steps:\n\n~~~yaml\n- name: build the image\n  run: make image\n"
    "- name: build the image\n  run: make image\n~~~",
    # a ~~~ block holding ``` lines of its own ends only at its ~~~
    "The README part:\n\n~~~markdown\nRun:\n```\nmake test\n```\nrun the cleanup step now.\n"
    "run the cleanup step now.\n~~~\n\nDone.",
]


@pytest.mark.parametrize("reply", CODE_REPLIES)
def test_lines_of_a_code_block_are_never_cut_as_repeats_streamed_or_not(reply):
    assert first_repeated_sentence(reply) is None  # a cut there left the block unclosed
    assert visible_answer(reply, stops=(), cut_repeats=True) == reply.rstrip()
    last_fence = max(reply.rfind("```"), reply.rfind("~~~"))
    assert repeat_in_progress(reply[: last_fence - 5]) == 0  # nothing held back inside the block


def test_prose_after_a_closed_code_block_is_still_cut_at_a_repeat():
    reply = "```\nx = 1\nx = 1\n```\nI hope this helps you. I hope this helps you. I hope"
    assert reply[: first_repeated_sentence(reply)] == "```\nx = 1\nx = 1\n```\nI hope this helps you. "


def test_prose_after_a_closed_tilde_block_is_still_cut_at_a_repeat():
    reply = "~~~\nx = 1\nx = 1\n~~~\nI hope this helps you. I hope this helps you. I hope"
    assert reply[: first_repeated_sentence(reply)] == "~~~\nx = 1\nx = 1\n~~~\nI hope this helps you. "


def test_chinese_and_japanese_replies_are_judged_word_by_character_and_cut_at_full_width_stops():
    reply = "你好，我是一个乐于助人的助手。我可以帮你查询订单的物流状态，请告诉我你的订单号。"
    assert reply_flags(reply, reply, [reply]) == ["repeats_earlier_reply"]  # one "word" per clause before
    assert reply_flags(reply, reply, ["今天天气很好，我们去公园散步吧。"]) == []
    assert is_repetition_loop("好的好的好的好的好的好的好的好的")
    prose = "我今天去了北京的故宫，看到了很多历史文物，感觉非常震撼。然后我们去吃了烤鸭，味道很好。"
    assert not is_repetition_loop(prose) and first_repeated_sentence(prose) is None
    looped = "你好！我可以帮你查询订单。我可以帮你查询订单。我可以"
    assert looped[: first_repeated_sentence(looped)] == "你好！我可以帮你查询订单。"
    japanese = "こんにちは。私はアシスタントです。私はアシスタントです。はい"
    assert japanese[: first_repeated_sentence(japanese)] == "こんにちは。私はアシスタントです。"


def test_a_looping_reply_leaves_the_context_at_once_and_stays_in_history_as_delivered(converse, scripted):
    loop = "10:30am: " * 12
    engine, _ = scripted(loop.strip(), "A fine answer.")
    conversation = converse(engine=engine, max_new_tokens=200)
    first = conversation.send("When does it open?")
    assert "repetition_loop" in first.stats.reply_flags
    assert "10:30am" not in conversation.context
    # a short clause six times in a row is cut before the sixth: the user gets five
    assert conversation.history[-1].content == ("10:30am: " * 5).strip()[:-1] + "."  # a cut ends a sentence
    assert "repetition_cut" in first.stats.reply_flags
    assert any(d.reason == "repetition loop" for d in first.decisions)
    delivered = len(engine.tokenizer.encode(conversation.history[-1].content, add_special_tokens=False))
    assert first.stats.dropped_tokens == delivered  # what left the context is counted as it leaves
    second = conversation.send("And at 10:30am?")  # sharing its token does not bring the loop back
    assert "10:30am: 10:30am" not in conversation.context and second.stats.reply_flags == []


def test_a_reply_that_repeats_an_earlier_one_leaves_the_context_and_the_original_stays(converse, scripted):
    answer = "You can find it on the website of the booking service, open every day from nine."
    engine, _ = scripted(answer, answer)
    conversation = converse(engine=engine, max_new_tokens=200)
    first, second = conversation.send("Where do I book?"), conversation.send("And the museum?")
    assert first.stats.reply_flags == [] and second.stats.reply_flags == ["repeats_earlier_reply"]
    assert conversation.context.count("open every day from nine") == 1
    assert [m.content for m in conversation.history if m.role == "assistant"] == [answer, answer]


def test_a_reply_is_cut_before_its_first_repeated_sentence_and_generation_stops(converse, scripted):
    looping = "You're welcome. I'm glad to help. I'm glad to help. I'm glad to help. I'm glad to help."
    engine, _ = scripted(looping)
    conversation = converse(engine=engine, max_new_tokens=300)
    streamed = "".join(conversation.stream("thanks!"))
    reply = conversation.last_reply
    assert streamed == reply.text == "You're welcome. I'm glad to help."
    assert reply.finish_reason == "repetition" and "repetition_cut" in reply.stats.reply_flags
    assert reply.stats.generated_tokens < len(engine.tokenizer.encode(looping))
    assert conversation.history[-1].raw_output.startswith(looping[:40])


def test_a_repeat_that_ends_with_the_generation_is_cut_and_flagged(converse, scripted):
    """The last sentence is complete only once the text ends: cut then, and flagged (a
    sweep through clm serve saw such a reply cut with no flag)."""
    engine, _ = scripted("Sure, the museum opens at nine. Sure, the museum opens at nine.")
    reply = converse(engine=engine, max_new_tokens=300).send("When does it open?")
    assert reply.text == "Sure, the museum opens at nine."
    assert reply.stats.reply_flags == ["repetition_cut"] and reply.finish_reason == "stop"


def test_a_repeat_cut_at_the_token_cap_finishes_as_a_repetition_not_length(converse, scripted):
    """The model ran to max_new_tokens, but the user got a reply cut short of it at a
    repeat: "length" would have an OpenAI client ask for more (a clm serve sweep)."""
    looping = "Sure, the museum opens at nine. Sure, the museum opens at nine."
    engine, _ = scripted(looping + " Sure")
    cap = len(engine.tokenizer.encode(looping, add_special_tokens=False))
    reply = converse(engine=engine, max_new_tokens=cap).send("When does it open?")
    assert reply.stats.generated_tokens == cap
    assert reply.text == "Sure, the museum opens at nine."
    assert "repetition_cut" in reply.stats.reply_flags and reply.finish_reason == "repetition"


def test_cut_repeats_can_be_turned_off(converse, scripted):
    looping = "You're welcome. I'm glad to help. I'm glad to help."
    engine, _ = scripted(looping)
    reply = converse(engine=engine, max_new_tokens=300, generation=None).send("thanks!")
    assert reply.text == "You're welcome. I'm glad to help."
    engine, _ = scripted(looping)
    settings = GenerationSettings(max_new_tokens=300, cut_repeats=False)
    assert converse(engine=engine, generation=settings).send("thanks!").text == looping


def test_streamed_answers_with_repeats_add_up_to_the_final_answer():
    raw = "One two three. Four five six. One two three. One two"
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
    final = visible_answer(raw, stops=(), cut_repeats=True)
    assert final == "One two three. Four five six."
    assert shown + stream.finish(final) == final and "One two three. One" not in shown


def _second_reply(converse, scripted, first: str, second: str):
    """The second of two scripted replies, and the context after it."""
    engine, _ = scripted(first, second)
    conversation = converse(engine=engine, max_new_tokens=300)
    conversation.send("Book the hotel.")
    return conversation.send("And the flight."), conversation.context


def test_a_templated_reply_with_a_new_fact_stays_in_the_context(converse, scripted):
    first = "Your booking is confirmed and your reference is AB-1234, is there anything else I can help with?"
    second = "Your booking is confirmed and your reference is ZK-9876, is there anything else I can help with?"
    reply, context = _second_reply(converse, scripted, first, second)
    assert reply.stats.reply_flags == ["repeats_earlier_reply"]
    assert "ZK-9876" in context and "AB-1234" in context


def test_a_hostile_marker_echo_reaches_neither_the_user_nor_the_context(converse, scripted):
    engine, _ = scripted("1234567890\n[seg_3] 1234567890\n[seg_4] done")
    conversation = converse(engine=engine, max_new_tokens=40)
    streamed = "".join(conversation.stream("echo the markers please"))
    reply = conversation.last_reply
    assert streamed == reply.text and "[seg_" not in reply.text
    assert reply.stats.reply_flags == ["protocol_artifact"]
    assert "[seg_" not in conversation.context


def test_a_marker_the_user_wrote_is_quoted_back_as_written(converse, scripted):
    """No protocol in the context, and the user's own message holds marker-like text: a
    reply that quotes it is the bare model's answer, shown whole (it was cut to
    "In your notes, and"), streamed the same, and not flagged."""
    quoted = "In your notes, [seg_3] and [LIFECYCLE] are labels from a tool."
    engine, _ = scripted(quoted)
    conversation = converse(engine=engine, max_new_tokens=200)
    streamed = "".join(conversation.stream("In my notes I wrote [seg_3] and [LIFECYCLE]. What do they mean?"))
    reply = conversation.last_reply
    assert reply.text == streamed == quoted
    assert "protocol_artifact" not in reply.stats.reply_flags
    assert quoted in conversation.context


@pytest.mark.parametrize(
    "raw",
    [
        "The tip is 2 euros. You can add up the tip, and you can add up the total, and you can add up the total. You",
        "Options: [Your Name] [Your Phone Number] [Your Email Address] [Your Phone Number] [Your Email Address] [Yo",
    ],
)
def test_a_stream_never_shows_a_repeated_clause_the_final_answer_cuts(raw):
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
    final = visible_answer(raw, stops=(), cut_repeats=True)
    assert shown + stream.finish(final) == final and len(final) < len(raw) * 0.8


def test_a_clause_said_again_after_a_linking_word_is_cut_there():
    # "X, but X." is a loop as "X, X" is (a tau-bench replay under clm: 47% repeated
    # 4-grams, under the loop flag's half, and no cut)
    raw = (
        "Theres a lot of information here, but I can help you with the rest. I can help you with theres a lot "
        "of information here, but I can help you with theres a lot of information here. I can help you"
    )
    assert visible_answer(raw, stops=(), cut_repeats=True) == (
        "Theres a lot of information here, but I can help you with the rest. I can help you with theres a lot "
        "of information here."
    )
    for said in ("I like tea, and I like coffee.", "Call me later, or call me tomorrow."):
        assert visible_answer(said, stops=(), cut_repeats=True) == said


def test_a_clause_that_repeats_inside_a_sentence_is_cut_too():
    raw = "The tip is 2 euros. You can add up the tip, and you can add up the total, and you can add up the total."
    assert visible_answer(raw, stops=(), cut_repeats=True) == (
        "The tip is 2 euros. You can add up the tip, and you can add up the total."
    )
    listed = "Rooms cost 2,400 euros; the suite costs 3,100 euros: both include breakfast."
    assert visible_answer(listed, stops=(), cut_repeats=True) == listed  # no clause repeats


@pytest.mark.parametrize(
    ("raw", "delivered"),
    [
        ("I'm sorry, I'm sorry, I'm sorry, I", "I'm sorry."),  # SmolLM2 through clm serve: "I'm sorry,"
        ("Sure, the hotel is near the park, the hotel is near the park, the", "Sure, the hotel is near the park."),
        ("Hello, world, 1,000 times: yes", "Hello, world, 1,000 times: yes"),  # no cut: every mark stays
    ],
)
def test_a_reply_cut_at_a_repeat_ends_a_sentence_not_a_clause_streamed_or_not(raw, delivered):
    assert visible_answer(raw, stops=(), cut_repeats=True) == delivered
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
    assert shown + stream.finish(delivered) == delivered


def test_sentences_glued_without_a_space_are_cut_at_the_repeat_streamed_or_not():
    """SmolLM2 in a 24-turn SGD chat (a helper's unseen-data sweep): the same sentence
    glued to itself until max_tokens, which the cut had read as one long sentence."""
    raw = "I'm sorry for any misunderstanding." * 4 + "I'm sorry for"
    delivered = "I'm sorry for any misunderstanding."
    assert visible_answer(raw, stops=(), cut_repeats=True) == delivered
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
    assert shown + stream.finish(delivered) == delivered
    for kept in (
        "import java.util.List;\nimport java.util.Map;\nimport java.util.Set;",
        "The U.S.Army base is near the river. The U.S.Army base is big.",
        "Version 2.Release notes are online at example.Org and in the docs.",
    ):
        assert visible_answer(kept, stops=(), cut_repeats=True) == kept


@pytest.mark.parametrize(
    ("raw", "delivered"),
    [
        (
            "The pickpockets are very, very, very, very, very, very, very, very, very",
            "The pickpockets are very, very, very, very, very, very.",
        ),
        ("Yes. Yes. Yes. Yes. Yes. Yes. Yes.", "Yes. Yes. Yes. Yes. Yes."),
        # emphasis up to five times stays, and the reply goes on (SmolLM2 on a support chat)
        ("No, no, no, no, no. I'm sorry for the mix-up.", "No, no, no, no, no. I'm sorry for the mix-up."),
        ("No, no, no! I said it twice, no, no.", "No, no, no! I said it twice, no, no."),  # emphasis stays
        ("It is very, very good, very, very good.", "It is very, very good, very, very good."),  # not in a row
    ],
)
def test_a_short_clause_four_times_in_a_row_is_cut_before_the_fourth(raw, delivered):
    """SmolLM2 with int4 weights on the bundled chat: 'very, very, very, ...' to the token
    limit, one word a clause, under the 3-word floor of the repeat cut."""
    assert visible_answer(raw, stops=(), cut_repeats=True) == delivered
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
    assert shown + stream.finish(delivered) == delivered


def test_a_run_of_bracketed_placeholders_that_repeats_is_cut():
    raw = (
        "The options are: [Your Name] [Your Phone Number] [Your Email Address] [Your Phone Number] "
        "[Your Email Address] [Your Phone"
    )
    assert visible_answer(raw, stops=(), cut_repeats=True) == (
        "The options are: [Your Name] [Your Phone Number] [Your Email Address]"
    )


LISTS_THAT_SHARE_CLAUSES = [
    # SmolLM2 asked to copy a list, as the bare model copies it (a sweep: cut to "... 2. Hakka,")
    "1. Golden Wok, located in the north, serves Chinese food.\n2. Hakka, located in the north, serves "
    "Chinese food.\n3. Nirala, located in the north, serves Indian food.",
    "Monday: open from 9 am to 5 pm.\nTuesday: open from 9 am to 5 pm.\nWednesday: closed.",
    "| A | north side, near the river |\n| B | north side, near the river |",
    "Train TR1923 leaves at 09:50, arrives at 10:07. Train TR4096 leaves at 09:50, arrives at 10:07 on Thursday.",
    # an item said again under another heading (a sweep: cut to "... Dinner in Shinjuku.\n\nDay 2:")
    "Day 1:\n- Breakfast at the hotel.\n- Visit Senso-ji in Asakusa.\n\nDay 2:\n- Breakfast at the hotel.\n"
    "- Visit the Meiji Shrine.\n\nDay 3:\n- Breakfast at the hotel.\n- Day trip to Nikko.",
    "Ingredients:\n- 2 eggs\n- 1 cup of milk\n\nFor the sauce:\n- 1 cup of milk\n- 1 tbsp butter\n\nWhisk, then bake.",
    "**Day 1**\n1. Morning: Visit the temple.\n2. Lunch by the river.\n**Day 2**\n1. Morning: Visit the temple.\n"
    "2. Lunch in the old town.",
    # lines opened by a label, or table rows, recur under other labels (a sweep: SmolLM2
    # copying an itinerary of bold labels was cut to "... Dinner by the river.\n\n**Day 3:**")
    "**Day 1:**\n**Morning:** Breakfast at the hotel.\n**Evening:** Dinner by the river.\n\n**Day 2:**\n"
    "**Morning:** Breakfast at the hotel.\n**Evening:** Walk in the old town.",
    "Day 1:\nMorning: Breakfast at the hotel.\nEvening: Dinner by the river.\nDay 2:\nMorning: Breakfast at the "
    "hotel.\nEvening: Walk in the old town.",
    "Q: Can I cancel?\nA: Yes, within 24 hours.\nQ: Can I change the date?\nA: Yes, within 24 hours.",
    "English: I love you.\nFrench: Je t'aime.\nEnglish: I love you.\nSpanish: Te quiero.",
    "| Name | Value |\n| --- | --- |\n| apple pie slice | 1 |\n| pear | 2 |\n| apple pie slice | 1 |",
]


def test_a_list_that_loops_is_still_cut_where_its_items_start_again():
    raw = (
        "Your plan:\n- Breakfast at the hotel.\n- Visit the temple.\n- Breakfast at the hotel.\n- Visit the temple.\n-"
    )
    assert (
        visible_answer(raw, stops=(), cut_repeats=True) == "Your plan:\n- Breakfast at the hotel.\n- Visit the temple."
    )
    same = "- Breakfast at the hotel.\n- Breakfast at the hotel.\n- Breakfast"
    assert visible_answer(same, stops=(), cut_repeats=True) == "- Breakfast at the hotel."


@pytest.mark.parametrize("reply", LISTS_THAT_SHARE_CLAUSES)
def test_items_of_a_list_that_share_clauses_are_not_cut_streamed_or_not(reply):
    assert visible_answer(reply, stops=(), cut_repeats=True) == reply
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(reply[:end]) for end in range(1, len(reply) + 1))
    assert shown + stream.finish(reply) == reply


def test_a_sentence_begun_again_with_an_earlier_sentences_first_clause_is_cut_there():
    """SmolLM2 on the bundled chat, at the token cap: the restart is cut as it is said."""
    raw = (
        "The weather in late April can be quite hot, and it's not too hot for the Mouraria. The weather can "
        "get quite hot, especially during the peak season. The weather can get quite hot, especially during the peak"
    )
    assert visible_answer(raw, stops=(), cut_repeats=True) == (
        "The weather in late April can be quite hot, and it's not too hot for the Mouraria. The weather can "
        "get quite hot, especially during the peak season."
    )


def test_a_stretch_of_clauses_said_again_right_after_itself_is_cut_at_its_repeat():
    looping = "Sure, you can pay by card, and the total is due today, you can pay by card, and the total is due"
    assert first_repeated_sentence(looping) is None  # said again only in part: not yet a loop
    looped = looping + " today, you can pay"
    assert looped[: first_repeated_sentence(looped)] == "Sure, you can pay by card, and the total is due today, "


@pytest.mark.parametrize(
    "sentence",
    ["The total budget is 1,200 euros.", "The flight lands at 10:30 am.", "It costs 3.5 euros, e.g. per ride."],
)
def test_a_repeated_sentence_with_punctuation_inside_a_number_or_word_is_cut(sentence):
    raw = f"{sentence} {sentence} {sentence} The"  # SmolLM2 in make demo: '1,200' hid the repeat
    assert visible_answer(raw, stops=(), cut_repeats=True) == sentence
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
    assert shown + stream.finish(sentence) == sentence


@settings(max_examples=30, deadline=None)
@given(pieces=st.lists(st.sampled_from(["a", ",", ".", " ", "1", ":", "]", "\n", "e.g"]), min_size=1, max_size=4))
def test_the_repeat_cut_takes_bounded_time_on_long_runs(pieces):
    text = ("".join(pieces) * (40_000 // len("".join(pieces)) + 1))[:40_000]
    started = time.perf_counter()
    first_repeated_sentence(text)
    repeat_in_progress(text)
    assert (
        time.perf_counter() - started < 5.0
    )  # linear: 40k characters of "a" took 80 s before (slack: two test workers share the cores)


def test_a_reply_cut_inside_a_character_ends_before_it_and_equals_its_stream(tiny_tok):
    from clm_middleware.lifecycle.reply import IncrementalText

    ids = tiny_tok.encode("café au lait", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tiny_tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalText(tiny_tok)
    streamed = "".join(detok.push(token) for token in ids[:cut])
    assert detok.text == streamed == "caf"
    assert streamed + "".join(detok.push(token) for token in ids[cut:]) == detok.text == "café au lait"


def _reference_cut_and_hold(text: str) -> tuple[int | None, int]:
    """The rule restated as a brute-force whole-text scan, kept plain as the oracle of the
    incremental watch: after each complete clause, every repeat complete so far (a
    sentence said before; a stretch of clauses from a repeated one on said again right
    after itself, tried over every pair; a run of REPEAT_RUN equal short clauses), the
    first clause at which any is complete giving the cut (its earliest start); and the
    unfinished tail's hold (the earliest start of what may still become such a repeat)."""
    from clm_middleware.lifecycle.reply_quality import (
        _LABEL_ONLY,
        _LABELLED_LINE,
        _LINKING_WORDS,
        _LIST_ITEM,
        _NUMBER_MARKER,
        _SENTENCE_END,
        _SENTENCE_MARKS,
        MARKUP_HELD,
        REPEAT_MIN_WORDS,
        REPEAT_RUN,
        _words,
    )

    clauses: list[tuple[int, str]] = []  # (start, words) of clauses with words
    openers: set[int] = set()  # the clauses that open a sentence
    items: set[int] = set()  # of those, the ones that open with a list marker
    sentences: list[tuple[int, str, bool]] = []  # (start, words, a list item) of complete sentences
    sentence: list[tuple[int, str]] = []
    after_marker = False  # the last clause with words was a number marker alone ("1.")
    start = 0
    line_open = True  # the next clause opens a line

    def repeats() -> list[int]:
        found = []
        words = [w for _, w in clauses]
        for i in range(len(words)):
            for j in range(i):
                period = i - j
                if len(words[i].split()) >= REPEAT_MIN_WORDS and words[i : i + period] == words[j:i]:
                    found.append(clauses[i][0])
                if (
                    {i, j} <= openers
                    and i not in items
                    and len(words[i].split()) >= REPEAT_MIN_WORDS
                    and words[i] == words[j]
                ):
                    found.append(clauses[i][0])
        keys = [w for _, w, _ in sentences]
        found += [
            at
            for n, (at, w, item) in enumerate(sentences)
            if not item and len(w.split()) >= REPEAT_MIN_WORDS and w in keys[:n]
        ]
        for n in range(REPEAT_RUN - 1, len(words)):
            run = words[n - REPEAT_RUN + 1 : n + 1]
            if len(run[0].split()) < REPEAT_MIN_WORDS and all(w == run[0] for w in run):
                found.append(clauses[n][0])
        return found

    def unlinked(words: list[str]) -> list[str]:  # a clause opening with "and", "but"... says the rest
        return words[1:] if len(words) > 1 and words[0] in _LINKING_WORDS else words

    def opens_item(unit: str, line_start: bool) -> bool:  # a list marker; or a label or table row opening a line
        return bool(_LIST_ITEM.match(unit.lstrip())) or (line_start and bool(_LABELLED_LINE.match(unit.lstrip())))

    for end in _SENTENCE_END.finditer(text):
        unit = text[start : end.end()]
        line_start = line_open or "\n" in unit[: len(unit) - len(unit.lstrip())]
        if line_start and end.group() != "\n" and _LABEL_ONLY.fullmatch(unit.strip()):
            continue  # a label and what follows it on its line are one clause
        start = end.end()
        line_open = unit.rstrip(" \t").endswith("\n") or (line_start and not unit.strip())
        said_words = [w for w in _words(unit) if w[0].isalnum()]
        if said_words:
            if not sentence:
                openers.add(len(clauses))
                if after_marker or opens_item(unit, line_start):
                    items.add(len(clauses))
            after_marker = bool(_NUMBER_MARKER.fullmatch(unit.strip()))
            clauses.append((start - len(unit.lstrip()), " ".join(unlinked(said_words))))
            sentence.append((clauses[-1][0], " ".join(said_words)))
        if any(mark in end.group() for mark in _SENTENCE_MARKS) and sentence:
            opener = len(clauses) - len(sentence)
            sentences.append((sentence[0][0], " ".join(w for _, w in sentence), opener in items))
            sentence = []
        if found := repeats():
            return min(found), 0
    tail = text[start:]
    tail_words = [w for w in _words(tail) if w[0].isalnum()]
    said = " ".join(tail_words)
    tail_at = len(text) - len(tail.lstrip())
    marks = "".join(tail.split())
    held = [tail_at] if 0 < len(marks) <= MARKUP_HELD and not tail_words else []  # markup waits for its words
    words = [w for _, w in clauses]
    for i in range(len(words)):  # a stretch repeating so far, not yet whole
        for j in range(i):
            if {i, j} <= openers and i not in items and words[i] == words[j]:
                continue  # that repeat would have been cut
            if len(words[i].split()) >= REPEAT_MIN_WORDS and words[i:] == words[j : j + len(words) - i]:
                held.append(clauses[i][0])
    long_words = [w for w in words if len(w.split()) >= REPEAT_MIN_WORDS]
    runs = words[-(REPEAT_RUN - 1) :] if len(words) >= REPEAT_RUN - 1 else []
    if said and any(w.startswith(" ".join(unlinked(tail_words))) for w in long_words):
        held.append(tail_at)
    if len(tail_words) == 1 and long_words and any(w.startswith(said) for w in _LINKING_WORDS):
        held.append(tail_at)  # a linking word, or its start, may still open a repeat
    if (
        said
        and runs
        and len(runs[0].split()) < REPEAT_MIN_WORDS
        and all(w == runs[0] for w in runs)
        and runs[0].startswith(" ".join(unlinked(tail_words)))
    ):
        held.append(tail_at)
    begun = " ".join([w for _, w in sentence] + ([said] if said else []))
    tail_line_start = line_open or "\n" in tail[: len(tail) - len(tail.lstrip())]
    item = (len(clauses) - len(sentence) in items) if sentence else after_marker or opens_item(tail, tail_line_start)
    if begun and not item and any(w.startswith(begun) and len(w.split()) >= REPEAT_MIN_WORDS for _, w, _ in sentences):
        held.append(sentence[0][0] if sentence else tail_at)
    return None, len(text) - min(held) if held else 0


SENTENCES = [
    "We book the room.",
    "and we book the room,",
    "but the room is 1,200 euros.",
    "\n- We book the room.",
    "\nMorning: we book the room.",
    "\n**Note:** We book the room.",
    "\nDay 2:\n",
    "\n| we book | the room |",
    "\n1. we book the rooms,",
    "\n2.",
    "we book the rooms,",
    "The room is 1,200 euros!",
    "e.g. the room",
    "Book it\n",
    "very,",
    "我们订房间。",
    "我们订房间，",
    "好！！",
]


@settings(max_examples=200, deadline=None)
@given(
    said=st.lists(st.sampled_from(SENTENCES), min_size=1, max_size=8),
    cut=st.integers(min_value=0, max_value=200),
)
def test_the_incremental_repeat_watch_agrees_with_a_whole_text_scan_at_every_token(said, cut):
    from clm_middleware.lifecycle.reply_quality import RepeatWatch

    text = " ".join(said)
    text = text[: len(text) - cut % len(text)]  # often ends inside a sentence that may become a repeat
    pieces = regex.findall(r"\s*\S{1,3}", text)  # token-sized steps, a word split across some
    watch, so_far = RepeatWatch(), ""
    for piece in pieces:
        so_far += piece
        watch.update(so_far)
        expected_cut, expected_hold = _reference_cut_and_hold(so_far)
        assert watch.cut == expected_cut
        if expected_cut is None:
            assert watch.in_progress(so_far) == expected_hold


def test_a_reply_that_ends_on_its_last_allowed_token_finished_with_stop_not_length(converse, scripted, tiny_tok):
    """OpenAI and vLLM check the stop before the cap: an end-of-turn token or a stop
    string that falls on the max_new_tokens-th token is "stop" (a sweep through clm serve
    saw "length" for a whole reply, and clients take "length" as cut off)."""
    text = "The museum opens at nine."
    ended = len(tiny_tok.encode(text, add_special_tokens=False)) + 1  # the reply and its EOS
    engine, _ = scripted(text, text)
    conversation = converse(engine=engine, max_new_tokens=ended)
    assert conversation.send("When does it open?").finish_reason == "stop"
    short = GenerationSettings(max_new_tokens=ended - 2)
    conversation.add("user", "And on Sundays?")
    assert conversation.respond(settings=short).finish_reason == "length"

    engine, _ = scripted("one two three four five six")
    at_stop = len(tiny_tok.encode("one two three four", add_special_tokens=False))
    settings = GenerationSettings(max_new_tokens=at_stop, stop=(" four",))
    conversation = converse(engine=engine, generation=settings)
    reply = conversation.send("Count.")
    assert (reply.text, reply.finish_reason) == ("one two three", "stop")


@pytest.mark.parametrize(
    ("raw", "delivered"),
    [
        # a labelled line that loops is cut before its label, not after it ("...\nNote.")
        (
            "Note: I'm sorry for the confusion.\nNote: I'm sorry for the confusion.\nNote: I'm",
            "Note: I'm sorry for the confusion.",
        ),
        # markup that opens a line before its words ("**", "|") is held with them: the
        # stream had shown "\n**" and "\n|" the final reply cut (a sweep: ChatCLM.invoke too)
        ("Hello there. I can help you.\n**I can help you.**\n**I can", "Hello there. I can help you."),
        (
            "| Name | Value |\n| --- | --- |\n| apple pie | 1 |\n| apple pie | 1 |\n| apple",
            "| Name | Value |\n| --- | --- |\n| apple pie | 1 |",
        ),
        # a heading whose content was cut keeps its colon ("Waffles." was no heading)
        (
            "Pancakes:\nMix the flour and milk.\nWaffles:\nMix the flour and milk.\nMix the",
            "Pancakes:\nMix the flour and milk.\nWaffles:",
        ),
    ],
)
def test_a_repeat_cut_near_markup_or_a_label_streams_exactly_the_final_reply(raw, delivered):
    assert visible_answer(raw, stops=(), cut_repeats=True) == delivered
    stream = ReplyFilter(stops=(), cut_repeats=True)
    shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
    assert shown + stream.finish(delivered) == delivered


@pytest.mark.parametrize(
    "document",
    [
        json.dumps(
            [{"name": name, "age": 30, "city": "Paris"} for name in ("Ann", "Bob", "Cy", "Dee", "Eve")], indent=2
        ),
        json.dumps([{"id": n, "done": False} for n in range(1, 8)]),
        "```html\n<ul>\n" + "\n".join(f'  <li><a href="#">Item {n}</a></li>' for n in range(1, 6)) + "\n</ul>\n```",
    ],
)
def test_markup_that_repeats_by_nature_is_no_repetition_loop(document):
    """A sweep: a well-formed JSON array, HTML list or table scored over the loop share on
    its brackets, quotes and bars, and would have left the context as a loop."""
    assert not is_repetition_loop(document)
    assert is_repetition_loop(document[:40] * 8)  # one row, said over and over, is one


def test_a_reply_of_emoji_streams_as_it_is_written():
    """Marks with no word were all held until the end (a sweep: an emoji reply arrived in
    one piece); only a short run that may open a line's markup waits for its words."""
    raw = "👨‍👩‍👧 🎉 " * 12
    stream = ReplyFilter(stops=(), cut_repeats=True)
    pieces = [stream.delta(raw[:end]) for end in range(1, len(raw) + 1)]
    final = visible_answer(raw, stops=(), cut_repeats=True)
    assert sum(1 for piece in pieces if piece) > 5
    assert "".join(pieces) + stream.finish(final) == final


def test_a_reply_cut_inside_an_emoji_sequence_drops_its_dangling_joiner_streamed_or_not():
    """The token cap can end a reply after the zero-width joiner of "👨‍👩‍👧" (the i18n
    sweep): the joiner joins nothing, so it is neither shown nor kept."""
    raw = "A family: 👨\u200d👩\u200d"
    for cut in (False, True):
        final = visible_answer(raw, stops=(), cut_repeats=cut)
        assert final == "A family: 👨\u200d👩"
        stream = ReplyFilter(stops=(), cut_repeats=cut)
        shown = "".join(stream.delta(raw[:end]) for end in range(1, len(raw) + 1))
        assert shown + stream.finish(final) == final
    whole = "A family: 👨\u200d👩\u200d👧"
    assert visible_answer(whole, stops=()) == whole


def test_a_short_reply_said_word_for_word_before_is_flagged_and_leaves_the_context(converse, scripted):
    """Too short for the n-gram share, "I'm sorry for any other confusion." answered 53 of
    70 messages of a sweep's chat, every copy kept and copied again; a short reply said
    once and a two-word one stay."""
    sorry = "I'm sorry for any other confusion."
    engine, _ = scripted("Sure.", "Sure.", sorry, sorry)
    conversation = converse(engine=engine, max_new_tokens=40)
    flags = [conversation.send(text).stats.reply_flags for text in ("Hi", "Book it", "Where?", "When?")]
    assert flags == [[], [], [], ["repeats_earlier_reply"]]
    assert conversation.context.count(sorry) == 1 and conversation.context.count("Sure.") == 2
    assert [m.content for m in conversation.history if m.role == "assistant"][-1] == sorry  # the user got it


NOTES = ["Cambridge.", "Alec's Hotel,", "arrive Friday", "cheap north,"]


@pytest.mark.parametrize(
    "reply",
    [
        "Alec's Hotel,\narrive Friday.",  # SmolLM2 at budget 128, to "Something cheap in the north, please."
        "Cambridge.\narrive Friday",
        "Cambridge. Alec's Hotel, arrive Friday cheap north, Cambridge. Alec's Hotel, arrive Friday",
    ],
)
def test_a_reply_that_reads_the_digest_back_is_flagged(reply):
    assert reads_back_notes(reply, NOTES)
    assert reply_flags(reply, reply, [], notes=NOTES) == ["reads_back_notes"]


@pytest.mark.parametrize(
    "reply",
    [
        "You arrive on Friday.",  # an answer that uses a note's fact in its own words
        "Alec's Hotel, in the north of Cambridge, is cheap and you arrive on Friday.",
        "arrive Friday",  # too short to judge
        "Alec's Hotel,\nIt has free parking.",  # one line is not a note
    ],
)
def test_an_answer_that_states_what_the_notes_hold_is_not_a_read_back(reply):
    assert not reads_back_notes(reply, NOTES) and reply_flags(reply, reply, [], notes=NOTES) == []


def test_a_reply_reading_the_notes_back_leaves_the_context_and_the_user_gets_it(converse, scripted):
    """The read-back says nothing the digest does not (it stays there); kept, a small
    model copies it again at every turn (SmolLM2 at budget 128: four turns in a row)."""
    engine, script = scripted()
    conversation = converse(engine=engine, budget=320, tagging="rules", max_new_tokens=60)
    for n in range(7):  # the 7th compacts: the next message fits, and the notes stay as they are
        conversation.add("user", f"Message {n}: order QX7-48{n}1 ships to Leeds.")
        conversation.respond(f"Noted order QX7-48{n}1.")
    notes = digest_lines(conversation.live_messages(), conversation.segment_map(), conversation.fold)
    assert len(notes) >= 2, "the budget must fold the oldest turns into the digest"
    read_back = "\n".join(notes[:2])
    script.add([*engine.tokenizer.encode(read_back, add_special_tokens=False), engine.tokenizer.eos_token_id])
    reply = conversation.send("Something cheap in the north, please.")
    assert not reply.stats.compaction
    assert reply.text == read_back and reply.stats.reply_flags == ["reads_back_notes"]
    assert conversation.history[-1].content == read_back  # the user got it as generated
    assert any(d.reason == "repetition loop" for d in reply.decisions)  # it left the context at once
    after = conversation.context.split("Something cheap in the north, please.")[-1]
    assert notes[0] not in after and notes[1] not in after


def test_a_repeat_that_runs_two_sentences_together_is_no_new_fact_and_leaves_the_context(converse, scripted):
    """'pas.Bien' reads as a dotted name (a distinctive token), but its words stand in the
    earlier reply in the same order: the repeat states nothing new (an unseen French chat
    had kept such a reply, and the next one copied it)."""
    first = "Je ne sais pas. Bien sûr, je ne sais pas ce que vous voulez dire par là."
    second = "Je ne sais pas.Bien sûr, je ne sais pas ce que vous voulez dire par là."
    repeat, context = _second_reply(converse, scripted, first, second)
    assert "repeats_earlier_reply" in repeat.stats.reply_flags
    assert "pas.Bien" not in context
