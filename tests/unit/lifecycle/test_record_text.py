"""Plain text as records (lines, sentences): a tool's result trimmed whole, repeats left out."""

from __future__ import annotations

import json

from clm_middleware.lifecycle.compressor import Compressor
from clm_middleware.lifecycle.prompts import summarizer_prompt
from clm_middleware.lifecycle.record_text import is_plain_records, leading_records, records, repeated_spans
from clm_middleware.lifecycle.segments import Segment, SegmentId
from clm_middleware.render import ChatFormat

LOG = "Log line: the parcel passed a sorting hub. " * 40
TABLE = "".join(f"第{i}便: 東京→大阪 出発 {8 + i % 10}:30, 料金 ¥{12000 + i * 150}。" for i in range(30))


def _pieces(text: str) -> list[str]:
    return [text[start:end] for start, end in records(text)]


def test_records_end_at_sentence_ends_full_width_stops_and_newlines_not_inside_numbers():
    text = "Price 3.5 euros, at 10.30 sharp.\nLine two\n\n第1便: 8:30。第2便: 9:30。Done! (ok)"
    assert _pieces(text) == [
        "Price 3.5 euros, at 10.30 sharp.\n",
        "Line two\n\n",
        "第1便: 8:30。",
        "第2便: 9:30。",
        "Done! ",
        "(ok)",
    ]
    assert "".join(_pieces(text)) == text
    hits = "1. Avenida Palace, 240 EUR.\n2. Memmo Alfama, 180 EUR.\n 10) Casa do Barao. It has 3. Rooms."
    assert _pieces(hits) == [
        "1. Avenida Palace, 240 EUR.\n",
        "2. Memmo Alfama, 180 EUR.\n",
        " 10) Casa do Barao. ",
        "It has 3. ",
        "Rooms.",
    ]


def test_a_record_said_again_right_after_itself_or_three_times_is_a_repeat_from_its_second_saying():
    text = "Sorted at hub A. Sorted at hub B. sorted  at hub A. Sorted at hub A."
    assert [text[a:b].strip() for a, b in repeated_spans(text)] == ["sorted  at hub A.", "Sorted at hub A."]
    retries = "Retrying.\nRetrying.\nDone."
    assert [retries[a:b] for a, b in repeated_spans(retries)] == ["Retrying.\n"]
    assert repeated_spans("One line only.") == []


def test_a_record_said_twice_apart_is_a_fact_of_each_place():
    """A reply's options each list their departure: the second is no repeat to leave out."""
    reply = "Option 1: HAT039.\n- Departure: 10:00 PM\nOption 2: HAT266.\n- Departure: 10:00 PM\n"
    assert repeated_spans(reply) == []


def test_leading_records_keep_whole_records_in_order_without_repeats():
    kept = leading_records(TABLE, lambda text: len(text) <= 120)
    assert kept is not None and TABLE.startswith(kept) and kept.endswith("。")
    assert len(kept) <= 120 and len(kept) + len(_pieces(TABLE)[len(_pieces(kept))]) > 120
    assert leading_records(LOG, lambda text: True) == "Log line: the parcel passed a sorting hub."
    assert leading_records(TABLE, lambda text: len(text) < 5) is None  # not even the first: the caller trims words
    assert leading_records("A single sentence with no end", lambda text: False) is None


def test_plain_records_are_two_or_more_and_not_json():
    assert is_plain_records(TABLE) and is_plain_records("first line\nsecond line")
    assert not is_plain_records("One sentence only.")
    assert not is_plain_records(json.dumps([{"a": "x. Y."}, {"a": "z. W."}]))


def _tool(text: str, chat: ChatFormat) -> Segment:
    return Segment(SegmentId("seg_5"), 5, 2, "tool", "tool", text, chat.encode(text), turn=2)


def _compressor(engine) -> Compressor:
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    return Compressor(engine, chat, method="extractive", target_ratio=4.0, summarizer_prompt=summarizer_prompt())


def test_a_tool_result_in_plain_text_is_trimmed_to_its_leading_whole_records(engine):
    """Cut word by word, sixty flights became times cut loose from their flights ("8:30,
    9:30, 10:30, 8:30"), which the agent could not answer from."""
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    result = _compressor(engine).trim(_tool(TABLE, chat), 120)
    assert result.ok and result.method == "trimmed" and len(result.token_ids) <= 120
    assert TABLE.startswith(result.text) and result.text.endswith("。")


def test_no_deletion_keeps_a_word_of_a_record_said_again(engine):
    """A log saying one line a hundred times was trimmed to its rarest word a hundred
    times ("Log Log Log ..."), and the agent called the tool again."""
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    squeezer = _compressor(engine)
    said_once = len(LOG.split()) // 40
    for result in (squeezer.compress(_tool(LOG, chat)), squeezer.tighten(_tool(LOG, chat))):
        assert result.ok and 0 < len(result.text.split()) <= said_once
    user = Segment(SegmentId("seg_2"), 2, 1, "user", "text", LOG, chat.encode(LOG), turn=1)
    trimmed = squeezer.trim(user, 40)  # a person's text: its words, not its records, but still once
    assert trimmed.ok and 0 < len(trimmed.text.split()) <= said_once
