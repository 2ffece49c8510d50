"""Rule labels, signal labels and eviction order, as documented in rules.py and signals.py."""

from clm_middleware.lifecycle.rules import RuleConfig, eviction_value, rule_label
from clm_middleware.lifecycle.segments import Label, Segment, SegmentId
from clm_middleware.lifecycle.signals import SignalThresholds, signal_label


def seg(
    text,
    *,
    kind="text",
    turn=1,
    tokens=10,
    surprisal=None,
    attention=0.0,
    pinned=False,
    label=Label.KEEP,
):
    return Segment(
        id=SegmentId("seg_1"),
        index=1,
        message_index=1,
        role="user",
        kind=kind,
        text=text,
        token_ids=list(range(tokens)),
        turn=turn,
        pinned=pinned,
        surprisal=surprisal,
        attention=attention,
        label=label,
    )


RULES = RuleConfig(recent_turns=2, compress_min_tokens=48, old_after_turns=4)


def test_rules_in_order():
    assert rule_label(seg("anything", pinned=True, kind="ack"), 10, RULES)[0] is Label.KEEP
    assert rule_label(seg("ok thanks", kind="ack", turn=10), 10, RULES)[0] is Label.DROP
    assert rule_label(seg("a long story " * 20, tokens=60, turn=9), 10, RULES)[0] is Label.KEEP  # recent
    assert rule_label(seg("order 88412 ships", tokens=60, turn=1), 10, RULES)[0] is Label.KEEP  # distinctive
    assert rule_label(seg("a long story " * 20, tokens=60, turn=1), 10, RULES) == (
        Label.COMPRESS,
        "long and old",
    )
    assert rule_label(seg("short and old", tokens=5, turn=1), 10, RULES)[0] is Label.KEEP


SIGNALS = SignalThresholds()


def test_signal_labels_follow_the_documented_thresholds():
    assert signal_label(seg("ok", kind="ack"), 5, SIGNALS)[0] is Label.DROP
    predictable_short = seg("sounds like a plan", tokens=5, surprisal=[1.0] * 5, turn=1)
    assert signal_label(predictable_short, 5, SIGNALS)[0] is Label.DROP
    assert signal_label(seg("order 88412", tokens=5, surprisal=[1.0] * 5, turn=1), 5, SIGNALS)[0] is Label.KEEP
    attended = seg("the blue house by the river", tokens=20, surprisal=[3.0] * 20, attention=3.0, turn=1)
    assert signal_label(attended, 5, SIGNALS)[0] is Label.KEEP
    long_predictable = seg("the weather was nice and " * 10, tokens=60, surprisal=[2.0] * 60, turn=1)
    label, reason = signal_label(long_predictable, 5, SIGNALS)
    assert label is Label.COMPRESS and "surprisal 2.00" in reason
    long_surprising = seg("quantum flux capacitors hum " * 10, tokens=60, surprisal=[6.0] * 60, turn=1)
    assert signal_label(long_surprising, 5, SIGNALS)[0] is Label.KEEP


def test_eviction_value_orders_drop_labels_first_and_facts_last():
    ack = seg("ok", kind="ack")
    labelled_drop = seg("some filler", label=Label.DROP)
    plain = seg("some filler")
    fact = seg("order 88412 ships")
    attended_fact = seg("order 88412 ships", attention=2.5)
    values = [eviction_value(s, s.attention) for s in (ack, labelled_drop, plain, fact, attended_fact)]
    assert values == sorted(values) and values[0] == values[1] and values[-1] > values[-2] > values[2]


def test_a_reply_ranks_below_the_same_fact_from_the_user():
    said = seg("order 88412 ships")
    replied = seg("order 88412 ships")
    replied.role = "assistant"
    assert eviction_value(replied) < eviction_value(said)


def test_a_reply_the_user_accepted_ranks_between_other_replies_and_what_the_user_said():
    said = seg("booked Casa do Rio for May 3rd")
    replied = seg("booked Casa do Rio for May 3rd")
    replied.role = "assistant"
    assert eviction_value(replied) < eviction_value(replied, accepted=True) < eviction_value(said)
    assert eviction_value(said, accepted=True) == eviction_value(said)  # acceptance is about replies


def test_a_tool_result_ranks_below_the_users_own_facts_and_above_the_models_replies():
    """An agent chat at budget 1024 kept a 300-token JSON search result and dropped the
    user's name and insurance number: the user's facts now go last."""
    said = seg("I'm Ana Lima, insurance number K-20931-7.")
    returned = seg('[{"therapist_name": "Leininger Anne", "phone_number": "408-847-2100"}]')
    returned.role = "tool"
    replied = seg("Leininger Anne, 408-847-2100.")
    replied.role = "assistant"
    assert eviction_value(replied) < eviction_value(returned) < eviction_value(said)
