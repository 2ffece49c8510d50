"""Trimming JSON by whole leading items: what is left parses and says less, never something else."""

from __future__ import annotations

import json

from clm_middleware.lifecycle.json_text import dump, json_facts, json_prefix

RECORDS = [{"flight": f"HA{i:03d}", "price": 90 + i, "seats": {"economy": i}} for i in range(10)]


def within(limit: int):
    return lambda text: len(text) <= limit


def test_a_list_keeps_its_leading_records_whole():
    trimmed = json_prefix(json.dumps(RECORDS), within(len(dump(RECORDS[:3])) + 1))
    assert json.loads(trimmed) == RECORDS[:3]


def test_an_object_keeps_its_leading_keys_with_their_values():
    profile = {"name": "Mia Li", "user_id": "mia_li_3668", "reservations": ["NO6JO3", "AIXC49"], "dob": "1990-04-05"}
    trimmed = json_prefix(json.dumps(profile), within(len(dump({"name": "Mia Li", "user_id": "mia_li_3668"}))))
    assert json.loads(trimmed) == {"name": "Mia Li", "user_id": "mia_li_3668"}


def test_where_no_top_level_item_fits_the_first_is_trimmed_inside_it():
    nested = [RECORDS, RECORDS]  # a search's itineraries, each a list of flights
    trimmed = json_prefix(json.dumps(nested), within(len(dump([RECORDS[:2]]))))
    assert json.loads(trimmed) == [RECORDS[:2]]


def test_text_that_is_no_json_array_or_object_or_where_nothing_fits_is_none():
    assert json_prefix("Flight HA001 leaves at 9.", within(1000)) is None
    assert json_prefix('"just a string"', within(1000)) is None
    assert json_prefix(json.dumps(RECORDS), within(5)) is None


def test_json_facts_keeps_every_key_and_value_in_order_without_the_syntax():
    profile = {"name": {"first_name": "Mia", "last_name": "Li"}, "reservations": ["NO6JO3", "AIXC49"], "vip": None}
    facts = json_facts(json.dumps(profile))
    assert facts == "name: (first_name: Mia, last_name: Li), reservations: (NO6JO3; AIXC49), vip: null"
    assert json_facts("[]") is None and json_facts("not json") is None


def test_a_json_tool_result_condenses_to_its_keys_and_values_not_to_broken_json(engine):
    from clm_middleware.lifecycle.compressor import JSON_FACTS, Compressor
    from clm_middleware.lifecycle.segments import Segment, SegmentId
    from clm_middleware.render import ChatFormat

    chat = ChatFormat(engine.tokenizer)
    text = json.dumps({"user_id": "mia_li_3668", "address": {"city": "Austin", "zip": "78750"}, "gold": True})
    segment = Segment(SegmentId("seg_1"), 1, 1, "tool", "text", text, chat.encode(text))
    outcome = Compressor(engine, chat, summarizer_prompt="{text}").compress(segment)
    assert outcome.ok and outcome.method == JSON_FACTS
    assert outcome.text == "user_id: mia_li_3668, address: (city: Austin, zip: 78750), gold: true"


def test_a_trimmed_object_keeps_its_leading_keys_and_the_leading_records_of_the_next_list():
    """A calendar of 30 events had been trimmed to {"date": ...} alone, losing every event
    in a prompt half empty (a helper's agent loop through clm serve)."""
    from clm_middleware.lifecycle.json_text import json_prefix

    events = [{"id": i, "title": f"Meeting {i}", "start": f"{9 + i % 8:02d}:00"} for i in range(30)]
    text = json.dumps({"date": "2025-03-14", "events": events, "timezone": "CET"})
    kept = json.loads(json_prefix(text, lambda t: len(t) <= 600))
    assert kept["date"] == "2025-03-14" and "timezone" not in kept
    assert 3 <= len(kept["events"]) < 30 and kept["events"] == events[: len(kept["events"])]  # records whole
    records = json.dumps(events)
    assert json.loads(json_prefix(records, lambda t: len(t) <= 200)) == events[:3]  # no record is cut
