"""Conversation mechanics on the tiny model: reuse, budget, reclamation, restore, tagging modes."""

import itertools
import json

import pytest
import torch
from whitespace_cases import WHITESPACE_MESSAGES

from clm_middleware import Conversation
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.calibration import CALIBRATION_CHATS
from clm_middleware.lifecycle.compaction import DIGEST_GLUE_TOKENS, ContextBudgetError
from clm_middleware.lifecycle.config import LifecycleConfig
from clm_middleware.lifecycle.segments import DecidedBy, Label, Status
from clm_middleware.lifecycle.tagging import TaggingConfig

FILLER = [
    "Tell me something about rivers and how they shape valleys over time.",
    "What about mountains, do they change as quickly as rivers do?",
    "And deserts, how are they formed in the first place?",
    "Which of these landscapes is the oldest one on our planet?",
    "Can you compare glaciers with rivers in a few words please?",
    "How do forests change the climate of a region around them?",
]


def test_a_turn_without_lifecycle_change_prefills_only_its_new_tokens(converse, engine):
    conversation = converse(system_prompt="Be brief.")
    previous = None
    for text in FILLER:
        reply = conversation.send(text)
        stats = reply.stats
        if previous is not None and not stats.compaction:
            new_tokens = stats.prompt_tokens - (previous.prompt_tokens + previous.generated_tokens) + 1
            assert stats.prefill_tokens <= new_tokens + engine.block_size, (
                stats.turn,
                stats.prefill_tokens,
                new_tokens,
            )
        previous = stats
    assert conversation.stats()["hit_rate"] > 0.5


def test_context_never_exceeds_the_budget_and_the_stats_say_what_was_removed(converse):
    conversation = converse(budget=420, system_prompt="Be brief.")
    turns = [conversation.send(text).stats for text in FILLER * 2]
    assert all(t.prompt_tokens <= 420 for t in turns)
    budget_turns = [t for t in turns if t.compaction == "budget"]
    assert budget_turns
    # the user waits for the compaction: it is part of the time to the first token
    assert all(t.phases["compaction_s"] + t.phases["compression_s"] <= t.ttft_s <= t.turn_s for t in turns)
    assert sum(t.dropped_tokens + t.compressed_tokens for t in turns) > 0
    assert any(
        t.decisions["by_source"]["rules"]["drop"] + t.decisions["by_source"]["rules"]["compress"] for t in budget_turns
    )
    assert len(conversation.history) == 2 * len(FILLER) * 2 + 1  # nothing is lost from history
    removed = [s for s in conversation.segments if s.status is not Status.ACTIVE]
    assert removed and all(s.text for s in removed if s.role == "user")


def test_a_new_message_that_cannot_fit_is_a_clear_error(converse):
    conversation = converse(budget=80)
    conversation.add("user", "word " * 200)
    with pytest.raises(ContextBudgetError, match="budget of 80"):
        conversation.respond()
    assert conversation.turn == 0  # the failed turn left no half state


def test_blocks_of_a_removed_segment_wait_k_rounds_then_return_to_the_pool(converse, engine):
    conversation = converse(k=2)
    conversation.send("My order number is 88412 and it ships to Porto next week.")
    conversation.send(FILLER[0])
    first = conversation.segments[0]
    held = conversation.blocks_of(first.id)
    assert held
    refs_before = engine.pool.ref_counts(held)
    conversation.forget(first.id)
    removed_at = first.removed_round
    assert conversation.reclaimer.is_held(first.id)
    assert [r - b for r, b in zip(engine.pool.ref_counts(held), refs_before, strict=True)] == [1] * len(held)
    conversation.send(FILLER[1])  # round removed_at + 1: still held
    assert conversation.turn == removed_at + 1 and conversation.reclaimer.is_held(first.id)
    conversation.send(FILLER[2])  # round removed_at + 2 = K rounds: released at the end of it
    assert not conversation.reclaimer.is_held(first.id)
    conversation.close()
    assert engine.pool.stats().blocks_in_use == 0


def test_a_segment_referenced_again_within_k_rounds_is_restored_and_its_blocks_still_hit(converse, engine):
    conversation = converse(k=2)
    conversation.send("Before anything else: my order number is 88412.")
    conversation.send(FILLER[0])
    target = conversation.segments[0]
    _, end = conversation._last_render.spans[target.id]
    conversation.forget(target.id)
    conversation.send(FILLER[1])  # the context no longer shows it
    assert "88412" not in conversation.context
    reply = conversation.send("Which order number did I give you, the 88412 one?")
    assert target.id in reply.stats.restored
    assert target.status is Status.ACTIVE and "88412" in conversation.context
    assert reply.stats.cached_tokens >= (end // engine.block_size) * engine.block_size
    assert any(d.segment_id == target.id and "referenced again" in d.reason for d in reply.decisions)


def test_the_models_own_labels_batch_until_they_free_enough_tokens(converse, scripted):
    def block(turn: int) -> str:  # each turn's block labels every segment: the user's so far drop
        return "Fine.\n[LIFECYCLE]\n" + "".join(f"seg_{2 * t}: drop\n" for t in range(turn + 1)) + "[/LIFECYCLE]"

    engine, _ = scripted(*(block(turn) for turn in range(4)))
    config = LifecycleConfig(tagging=TaggingConfig(mode="free"), min_reclaim_tokens=24)
    conversation = converse(engine=engine, config=config, max_new_tokens=64)
    for text in ("ok thanks", "cool", "great thanks", "nice"):
        conversation.send(text)
    dropped = [s.status is Status.DROPPED for s in conversation.segments if s.role == "user"]
    compactions = [t.compaction for t in conversation.turn_log]
    assert compactions[:2] == ["", ""]  # each drop alone frees too little to re-prefill for
    assert "pending" in compactions and any(dropped)


@pytest.mark.parametrize("tagging", ["rules", "signals"])
def test_without_a_budget_labels_from_signals_or_rules_never_apply_so_the_context_is_the_bare_templates(
    converse, tiny_tok, tagging
):
    """They are no choice of the model's, and without a budget nothing needs the room:
    through clm serve with no budget, SmolLM2's signals had dropped "Tell me a joke."
    and kept its answer, which then followed "What is my name?"."""
    conversation = converse(system_prompt="Be brief.", tagging=tagging)
    exchanges = [
        ("ok thanks", "You're welcome."),
        ("Tell me a joke.", "Why did the chicken cross the road? To get to the other side."),
        ("cool", "Glad you liked it."),
        ("great thanks", "Anytime."),
        ("What is my name?", "You have not told me your name."),
        ("ok", "Anything else?"),
    ]
    for text, reply in exchanges:
        conversation.add("user", text)
        conversation.respond(reply)
    assert all(s.status is Status.ACTIVE for s in conversation.segments)
    assert all(t.compaction == "" for t in conversation.turn_log)
    bare = [{"role": "system", "content": "Be brief."}]
    for text, reply in exchanges:
        bare += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    assert conversation.context == tiny_tok.apply_chat_template(bare, tokenize=False)


def test_without_a_budget_a_drop_label_on_a_users_question_waits_and_the_rest_applies(converse, scripted):
    """The question guard: a common question is predictable, not content-free (SmolLM2's
    signals dropped "How do I get from the airport to the city center?", 1.82 nats/token,
    and the context then showed two replies in a row)."""
    block = "Pack a raincoat.\n[LIFECYCLE]\nseg_0: drop\nseg_1: drop\n[/LIFECYCLE]"
    engine, _ = scripted(block, "Sure.")
    config = LifecycleConfig(tagging=TaggingConfig(mode="free"), min_reclaim_tokens=1)
    conversation = converse(engine=engine, config=config, max_new_tokens=64)
    conversation.send("What should I pack for a rainy trip? I will be walking a lot.")
    conversation.send("And for a sunny one?")
    question, statement = conversation.segments[:2]
    assert question.kind == "question" and question.status is Status.ACTIVE
    assert statement.status is Status.DROPPED and conversation.turn_log[-1].compaction == "pending"
    assert "What should I pack for a rainy trip?" in conversation.context
    assert "walking a lot" not in conversation.context


def test_under_a_budget_labels_wait_until_the_prompt_would_exceed_it(converse):
    conversation = converse(tagging="rules", budget=4000)
    for text in ("ok thanks", "cool", "great thanks", "ok", "thanks a lot", "nice", "ok cool", "fine"):
        conversation.send(text)
    acks = [s for s in conversation.segments if s.kind == "ack" and s.role == "user"]
    assert acks and all(s.label is Label.DROP for s in acks)
    assert all(s.status is Status.ACTIVE for s in acks)  # the context fits: it shows them
    assert all(t.compaction == "" for t in conversation.turn_log)
    assert all(t.text in conversation.context for t in acks)


def test_a_segment_is_named_by_its_number_as_well_as_by_its_id(converse):
    """``forget(3)`` said "no segment 3" while clm chat's /forget 3 worked (a helper's probe)."""
    conversation = converse(budget=1000)
    conversation.send("My booking code is BH-7741.")
    first = conversation.history[0].segment_ids[0]
    number = int(first.removeprefix("seg_"))
    assert conversation.segment(number) is conversation.segment(str(number)) is conversation.segment(first)
    assert conversation.forget(number).id == first
    with pytest.raises(ConfigError, match="no segment 'seg_999'"):
        conversation.pin(999)
    with pytest.raises(ConfigError, match="no segment True"):
        conversation.segment(True)


def test_pinned_segments_survive_budget_pressure_and_forget_removes_them_and_their_pin(converse):
    conversation = converse(budget=360)
    conversation.send("Remember the code WX-5521 for the locker, it matters.")
    kept = conversation.pin(conversation.segments[0].id)
    for text in FILLER * 2:
        conversation.send(text)
    assert kept.status is Status.ACTIVE and "WX-5521" in conversation.context
    forgotten = conversation.forget(kept.id)
    assert forgotten.status is Status.DROPPED and "WX-5521" not in conversation.context
    assert not forgotten.pinned  # forgetting overrides the pin: brought back later, it is ordinary
    assert any("WX-5521" in m.content for m in conversation.history)
    with pytest.raises(ConfigError, match="no segment"):
        conversation.pin("seg_999")


def test_what_the_user_forgets_counts_in_the_next_turns_dropped_tokens(converse):
    conversation = converse()
    conversation.send("Remember the code WX-5521 for the locker, it matters.")
    forgotten = conversation.forget(conversation.segments[0].id)
    after = conversation.send("What else should I pack?")
    assert after.stats.dropped_tokens == len(forgotten.token_ids) > 0
    assert conversation.send("Thanks.").stats.dropped_tokens == 0  # counted once
    assert conversation.stats()["dropped_tokens"] == len(forgotten.token_ids)


def test_a_forgotten_system_prompt_takes_its_turn_with_it(converse, tiny_tok):
    """As any message that leaves the context: the prompt starts as the chat template's
    does without a system message, not with an empty system turn."""
    conversation = converse(system_prompt="Talk like a pirate.")
    conversation.forget(conversation.segments[0].id)
    conversation.add("user", "hello")
    prompt = conversation.render_prompt(conversation.next_segment_id()).token_ids
    bare = tiny_tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert tiny_tok.decode(prompt) == bare
    assert conversation.respond().turn == 1


def test_fork_shares_a_prefix_of_the_history_and_refuses_a_count_outside_it(converse):
    conversation = converse(system_prompt="Be brief.")
    conversation.send("My order number is 88412.")
    conversation.send("Where is it now?")
    twin = conversation.fork(3)  # system, the first question and its reply
    assert [m.content for m in twin.history] == [m.content for m in conversation.history[:3]]
    assert conversation.context.startswith(twin.context)  # that prefix renders as it does here
    assert twin.send("Thanks.").turn == 2
    for bad in (-1, len(conversation.history) + 1, True, 1.0):
        with pytest.raises(ConfigError, match=r"messages: must be an integer from 0 to 5"):
            conversation.fork(bad)


def test_a_fork_of_a_compacted_conversation_shows_what_fits_verbatim_and_never_folds_its_newest_exchange(converse):
    """A client starting a new chat that opens as an old, compacted one did (or editing an
    early message) gets its messages as said, not the old chat's notes of them."""
    conversation = converse(budget=320, system_prompt="Be brief.")
    conversation.send("My order number is 88412. " + FILLER[0])
    for text in FILLER * 2:
        conversation.send(text)
    assert conversation.fold > 2  # the opening exchange is folded into the digest
    opening = conversation.fork(2)  # the system prompt and the first message, to be answered
    assert opening.fold == 0 and all(s.status is Status.ACTIVE for s in opening.segments)
    assert "My order number is 88412. " + FILLER[0] in opening.context
    long = conversation.fork(len(conversation.history) - 1)  # too long to show whole: regenerate the last reply
    newest = long.history[-1]
    assert newest.role == "user" and long.fold <= newest.index
    assert all(long.segment(s).status is Status.ACTIVE for s in newest.segment_ids)
    assert long.send("Thanks.").stats.prompt_tokens <= 320


def test_free_mode_parses_the_models_block_and_the_user_never_sees_it(converse, scripted):
    engine, _ = scripted("Noted.\n[LIFECYCLE]\nseg_1: drop\nseg_0: keep\n[/LIFECYCLE]", "Sure thing.")
    conversation = converse(engine=engine, tagging="free")
    streamed = "".join(conversation.stream("My code is 77. ok thanks for that"))
    reply = conversation.last_reply
    assert streamed == reply.text == "Noted."
    assert "seg_1: drop" not in conversation.context and "LIFECYCLE" not in reply.text
    assert reply.stats.parse_ok is True and reply.stats.tagging_mode == "free"
    by_id = {d.segment_id: d for d in reply.decisions}
    assert by_id["seg_1"].label is Label.DROP and by_id["seg_1"].decided_by is DecidedBy.MODEL
    assert "[LIFECYCLE]" in conversation.history[-1].raw_output
    second = conversation.send("and then?")
    assert second.stats.parse_ok is False and second.stats.tagging_mode == "rules"  # no block: rules


BLOCK = "OK.\n[LIFECYCLE]\nseg_0: keep\nseg_1: keep\n[/LIFECYCLE]"
CALIBRATION_PASSES = [BLOCK] * len(CALIBRATION_CHATS)  # the calibration probes come first


def test_auto_uses_the_model_while_it_follows_the_protocol(converse, scripted):
    engine, _ = scripted(*CALIBRATION_PASSES, *[BLOCK] * 6)
    conversation = converse(engine=engine, tagging="auto")
    assert conversation.calibration.follows and conversation.protocol_context
    modes = [conversation.send(f"message number {i} here").stats.tagging_mode for i in range(6)]
    assert modes == ["free"] * 6
    assert conversation.protocol_context


def test_auto_never_shows_the_protocol_to_a_model_that_fails_calibration(converse, scripted):
    engine, script = scripted(*["[seg_9] No block here."] * 8)
    conversation = converse(engine=engine, tagging="auto", max_new_tokens=60)
    assert conversation.calibration.follows is False
    assert conversation.calibration.probes == 1 and script.started == 1  # one failure decided it
    stats = [conversation.send(f"message number {i} here").stats for i in range(3)]
    assert [(s.protocol_context, s.tagging_mode) for s in stats] == [(False, "signals")] * 3
    assert "[seg_" not in conversation.context and "Label segments" not in conversation.context
    assert [m.content for m in conversation.history if m.role == "assistant"] == ["No block here."] * 3
    assert conversation.stats()["parse_rate"] is None  # no turn asked for a block, as the replay report says


def test_auto_switches_to_signals_after_a_parse_failure_streak(converse, scripted):
    engine, _ = scripted(*CALIBRATION_PASSES, *["No block here."] * 8)
    conversation = converse(engine=engine, tagging="auto")
    stats = [conversation.send(f"message number {i} here").stats for i in range(7)]
    assert [s.tagging_mode for s in stats] == ["signals"] * 7
    assert [s.protocol_context for s in stats] == [True] * 5 + [False] * 2
    assert conversation.tagger.parse_rate == 0.0 and not conversation.protocol_context
    assert conversation.stats()["parse_rate"] == 0.0  # the five turns that asked parsed no block
    assert "[seg_" not in conversation.context


def test_a_model_that_failed_the_protocol_starts_later_auto_conversations_in_signals(converse, scripted):
    engine, _ = scripted(*CALIBRATION_PASSES, *["No block here."] * 7)
    first = converse(engine=engine, tagging="auto")
    for i in range(5):
        first.send(f"message number {i} here")
    assert not first.protocol_context
    second = converse(engine=engine, tagging="auto")
    assert not second.protocol_context and "[seg_" not in second.context
    assert second.calibration.source == "runtime"
    stats = [second.send(f"again {i}").stats for i in range(2)]
    assert [(s.protocol_context, s.tagging_mode) for s in stats] == [(False, "signals")] * 2
    other_engine, _ = scripted(*CALIBRATION_PASSES)
    assert converse(engine=other_engine, tagging="auto").protocol_context  # the verdict is per engine


def test_constrained_mode_always_parses(converse):
    conversation = converse(tagging="constrained")
    replies = [conversation.send(text) for text in FILLER[:3]]
    for reply in replies:
        assert reply.stats.tagging_mode == "constrained"
        assert reply.decisions and all(d.decided_by is DecidedBy.CONSTRAINED for d in reply.decisions)
        assert all(0.0 <= d.confidence <= 1.0 for d in reply.decisions)


def test_teacher_forced_replies_are_kept_verbatim(converse):
    conversation = converse()
    conversation.add("user", "Say hello.")
    reply = conversation.respond("Hello there, friend.")
    forced = conversation.chat_format.encode("Hello there, friend.")
    assert reply.text == "Hello there, friend." and reply.stats.generated_tokens == 0
    assert reply.stats.forced_tokens == len(forced)
    assert conversation.history[-1].content == "Hello there, friend."


def test_a_block_inside_a_teacher_forced_reply_is_never_parsed_as_the_models_own(converse):
    conversation = converse(tagging="free")
    conversation.add("user", "My locker code is 4417. Please keep it.")
    reply = conversation.respond("Noted.\n[LIFECYCLE]\nseg_0: drop\n[/LIFECYCLE]")  # the transcript's text
    assert reply.stats.decisions["by_source"]["model"]["drop"] == 0 and reply.stats.parse_ok is not True
    assert conversation.segments[0].label is not Label.DROP and "4417" in conversation.context


def test_reply_nll_of_a_forced_reply_equals_a_direct_computation(converse, tiny_model):
    conversation = converse(system_prompt="Be kind.")
    conversation.add("user", "Say hello.")
    prompt = conversation.context_ids + list(conversation.chat_format.generation_prompt_ids)
    reply = conversation.respond("Hello there, friend.")
    forced = conversation.chat_format.encode("Hello there, friend.")
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompt + forced])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    direct = -sum(float(logprobs[len(prompt) - 1 + j, token]) for j, token in enumerate(forced)) / len(forced)
    assert reply.stats.reply_nll == pytest.approx(direct, abs=1e-4)
    # the reply's blocks were stored with the turn: the next turn reuses prompt + reply
    nxt = conversation.send("Again?")
    # all of it, but for the attention window (the prompt's last 32 positions, computed by every observed call)
    window = conversation.config.tagging.attention_window
    assert nxt.stats.cached_tokens >= min(len(prompt) + len(forced) - 1, nxt.stats.prompt_tokens - window)
    assert nxt.stats.reply_nll is None and conversation.stats()["reply_nll"] == reply.stats.reply_nll


def test_an_assistant_greeting_and_two_user_messages_in_a_row_are_answered(converse):
    conversation = converse()
    conversation.add("assistant", "Hi! I am the booking bot. How can I help?")
    conversation.add("user", "A table for two.")
    conversation.add("user", "At 8 pm, please.")
    reply = conversation.respond()
    assert reply.turn == 1 and [m.role for m in conversation.history] == ["assistant", "user", "user", "assistant"]
    assert "booking bot" in conversation.context and "8 pm" in conversation.context


def test_an_empty_message_of_any_role_renders_as_the_chat_templates_empty_turn(converse, tiny_tok):
    conversation = converse(system_prompt="Be brief.")
    messages = [("user", ""), ("assistant", ""), ("user", "and now?"), ("tool", ""), ("system", ""), ("user", "")]
    for role, content in messages:
        conversation.add(role, content)
    prompt = conversation.render_prompt(conversation.next_segment_id()).token_ids
    bare = [{"role": "system", "content": "Be brief."}] + [{"role": r, "content": c} for r, c in messages]
    expected = tiny_tok.apply_chat_template(bare, tokenize=False, add_generation_prompt=True)
    assert tiny_tok.decode(prompt) == expected  # no user, user where the caller sent user, assistant, user
    assert conversation.respond().turn == 1


def test_an_empty_system_message_first_is_an_empty_system_turn_not_the_templates_default(converse, tiny_tok):
    conversation = converse()
    conversation.add("system", "")
    conversation.add("user", "hello")
    prompt = conversation.render_prompt(conversation.next_segment_id()).token_ids
    bare = [{"role": "system", "content": ""}, {"role": "user", "content": "hello"}]
    assert tiny_tok.decode(prompt) == tiny_tok.apply_chat_template(bare, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("text", [*WHITESPACE_MESSAGES, "   leading spaces. Then another sentence."])
def test_the_context_holds_a_message_as_written_whatever_its_whitespace(
    converse, tiny_tok, context_and_bare_template, text
):
    """The bare chat template passes content through verbatim; so does the context."""
    conversation = converse(system_prompt="Be brief.\n")
    messages = [("system", "Be brief.\n"), ("user", text), ("assistant", "  Fine.\n"), ("user", "And?")]
    prompt, expected = context_and_bare_template(conversation, tiny_tok, messages)
    assert tiny_tok.decode(prompt) == expected
    assert prompt == tiny_tok.encode(expected, add_special_tokens=False)


def test_a_budget_the_system_block_alone_fills_fails_at_once_and_names_it(converse):
    with pytest.raises(ContextBudgetError, match=r"system block \(protocol prompt\) takes \d+ tokens.*signals"):
        converse(tagging="free", budget=128, protocol_prompt=None)  # the default prompt, in the tiny tokenizer's bytes
    with pytest.raises(ContextBudgetError, match=r"system block \(system messages\)"):
        converse(budget=64, system_prompt="Answer in the style of a ship's log. " * 4)
    conversation = converse(budget=128)
    conversation.send("hello")
    with pytest.raises(ContextBudgetError, match="leaves no room for a message in a budget of 128"):
        conversation.add("system", "From now on, answer in the style of a ship's log, please. " * 3)
    assert [m.role for m in conversation.history] == ["user", "assistant"]  # the refused message is gone
    assert conversation.send("and again").turn == 2


def test_a_budget_that_leaves_the_window_no_room_for_a_reply_is_warned_of_with_the_budget_that_fits(converse, engine):
    """Budget 1024 on a 1024-token llama-server slot cut every reply near the budget within
    a few tokens (a helper's probe). A warning, not an error: max_new_tokens is a cap, and
    one set to the window asks for no room."""
    import warnings

    positions = engine.max_positions
    with pytest.warns(RuntimeWarning, match=rf"no room for a reply of up to 64 tokens.*{positions - 64} or less"):
        converse(budget=positions - 10, max_new_tokens=64).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converse(budget=positions - 64, max_new_tokens=64).close()
        converse(budget=positions // 2, max_new_tokens=positions).close()  # replies as long as they may be
    with pytest.raises(ConfigError, match=rf"over the {positions} positions"):
        converse(budget=positions + 1)


def test_a_turn_refused_for_the_budget_says_what_the_system_block_takes_of_it(converse):
    """At budget 256 SmolLM2's protocol prompt alone takes ~220 tokens; the refusal said
    only "the prompt needs N tokens", not why so little room was left."""
    system = "Answer in the style of a ship's log, with the date and the weather first."
    conversation = converse(budget=256, system_prompt=system)
    fixed = conversation.system_block_tokens()
    assert 256 > fixed >= 256 // 4
    with pytest.raises(ContextBudgetError, match=rf"the system block \(system messages\) takes {fixed} of the 256"):
        conversation.send("Order QX7-4821 ships on April 22 to 14 Elm Street, Leeds, code 9931-AZ. " * 4)
    small = converse(budget=512)
    with pytest.raises(ContextBudgetError) as refused:
        small.send("Order QX7-4821 ships on April 22 to 14 Elm Street, Leeds, code 9931-AZ. " * 12)
    assert "system block" not in str(refused.value)  # a few tokens of chat glue are no news


def test_close_gives_every_block_back(converse, engine):
    with converse(k=3) as conversation:
        for text in FILLER[:4]:
            conversation.send(text)
        conversation.forget(conversation.segments[1].id)
        assert engine.pool.stats().blocks_in_use > 0
    assert engine.pool.stats().blocks_in_use == 0
    engine.pool.check_invariants()


def test_a_new_message_over_the_budget_is_condensed_faithfully_when_that_fits(converse):
    conversation = converse(budget=320, tagging="signals")
    filler = "the weather was mild and we walked along the river for hours " * 6
    reply = conversation.send(f"Order QX7-4821 ships on April 22. {filler}")
    assert reply.stats.prompt_tokens <= 320
    assert "QX7-4821" in conversation.context and "April 22" in conversation.context
    assert any(s["ok"] for s in reply.stats.summaries)


@pytest.mark.parametrize("over", [1, 4])
def test_a_new_message_just_over_the_budget_loses_fillers_not_what_bounds_its_facts(converse, over):
    """A message a few tokens over the budget is cut by about what is needed, fillers
    first: until 2026-12-07 it was condensed whole ("leaving after 19:30" → "19:30", "one
    child aged seven" → "aged", "in the south" → "south" lost on SmolLM2, 10-14 tokens cut
    where 1 was needed)."""
    message = (
        "We are two adults and one child aged seven, leaving after 19:30 on Friday, "
        "and we would rather stay in the south near the station."
    )
    measured = converse()
    full = measured.send(message).stats.prompt_tokens
    conversation = converse(budget=full - over)
    reply = conversation.send(message)
    assert full - over - 3 * over <= reply.stats.prompt_tokens <= full - over
    shown = conversation.context
    for kept in ("two adults", "one child aged seven", "after 19:30", "Friday", "south", "station"):
        assert kept in shown
    assert [s["method"] for s in reply.stats.summaries if s["ok"]] == ["trimmed"]


@pytest.mark.parametrize(
    ("opening", "closing"),
    [("What is the most common word? ", ""), ("Summarize this text: ", ""), ("", " Which word comes up most often?")],
)
def test_a_paste_cut_to_fit_keeps_the_instruction_around_it(converse, opening, closing):
    """A new message over the budget whose instruction and paste are one segment (no
    sentence break the segmenter sees) is cut in the paste: on SmolLM2 the cut had taken
    "What is the most common word?" whole from before a 1,000-word list."""
    words = ["apple", "river", "stone", "cloud", "music", "table", "window", "garden", "silver", "yellow"]
    paste = " ".join(words[(i * 7) % len(words)] for i in range(160))
    message = f"{opening}{paste}{closing}"
    full = converse().send(message).stats.prompt_tokens
    conversation = converse(budget=full - 12)
    conversation.send(message)
    assert (opening.strip() or closing.strip()) in conversation.context


def test_a_long_new_message_is_scored_in_one_call_and_its_question_is_condensed_last(converse, engine, monkeypatch):
    """Condensing a paste scores its pieces in one forward, not one forward per piece, and
    the question the user asks about it stays as asked while other pieces can shrink."""
    conversation = converse(budget=320, tagging="signals")
    conversation.send("Hello there.")
    unpooled = []
    generate = engine.generate

    def counted(*args, **kwargs):
        if kwargs.get("use_pool") is False:
            unpooled.append(len(args[0]))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", counted)
    filler = " ".join(f"The river walk number {n} was mild and long." for n in range(12))
    question = "What was the first walk called?"
    reply = conversation.send(f"{filler}\n\n{question}")
    assert reply.stats.prompt_tokens <= 320 and len([s for s in reply.stats.summaries if s["ok"]]) > 1
    assert len(unpooled) == 1
    assert question in conversation.context


def test_a_history_added_in_one_call_fits_the_budget_as_it_would_turn_by_turn(converse):
    """A client re-sending a whole chat to a fresh conversation (a restarted server, an
    edit far back, a few-shot prompt): its earlier exchanges are older turns, and only
    the newest message is protected from compaction."""
    pairs = [(f"Message {n}: order QX7-48{n}1 and some ordinary chat text.", f"Reply {n}, noted.") for n in range(8)]
    seeded = converse(budget=160, tagging="signals")
    for user, reply in pairs:
        seeded.add("user", user)
        seeded.add("assistant", reply)
    seeded.add("user", "Which orders did I mention?")
    reply = seeded.respond()
    assert reply.stats.prompt_tokens <= 160 and reply.stats.compaction == "budget"
    assert "Which orders did I mention?" in seeded.context  # the newest message stays verbatim
    with pytest.raises(ContextBudgetError, match="the new message has"):  # still bounded: one huge message
        seeded.send("x " * 400)


def _forced_turns(conversation, pairs):
    for user, reply in pairs:
        conversation.add("user", user)
        conversation.respond(reply)


def _request_then_filler(converse, request_share: float, requests: list[str]) -> tuple[Conversation, list]:
    config = LifecycleConfig(tagging=TaggingConfig(mode="rules"), budget=420, request_share=request_share)
    conversation = converse(config=config)
    decisions = []
    for user, reply in [(text, "Sure.") for text in requests] + [(text, "we talked about that.") for text in FILLER]:
        conversation.add("user", user)
        decisions += conversation.respond(reply).decisions
    return conversation, decisions


REQUEST = "Okay then, can you look for it in the north instead then, please?"


def test_a_plain_word_request_is_folded_condensed_and_held_in_the_digest_like_a_fact(converse):
    """Folded, a request in plain words is condensed to its content words (chatter is
    dropped) and stays in the digest, as a fact would, within request_share of the
    budget (a quarter here: room for every folded request); the verbatim messages after
    the fold stay whole."""
    conversation, decisions = _request_then_filler(converse, 0.25, [REQUEST])
    folded = next(s for s in conversation.segments if s.text == REQUEST)
    labels = [d.label for d in decisions if d.segment_id == folded.id and d.reason == "budget"]
    assert labels == [Label.COMPRESS] and folded.visible  # condensed when folded, and kept
    assert "north" in folded.summary and "north" in conversation.context
    window = conversation.history[conversation.fold :]
    assert all(conversation.segment(s).status is Status.ACTIVE for m in window for s in m.segment_ids)


def test_without_request_share_a_plain_word_request_leaves_before_the_verbatim_messages(converse):
    conversation, decisions = _request_then_filler(converse, 0.0, [REQUEST])
    folded = next(s for s in conversation.segments if s.text == REQUEST)
    labels = [d.label for d in decisions if d.segment_id == folded.id and d.reason == "budget"]
    assert labels == [Label.COMPRESS, Label.DROP]  # condensed when folded, then dropped for room
    assert "north" not in conversation.context


def test_request_share_holds_the_most_surprising_requests_first(converse, monkeypatch):
    """Two requests, room in the share for one: the one the model found more surprising
    where it was said stays (the tiny model's own scores are noise: they are set here,
    the filler's lowest)."""
    plain = "Could you find a quiet place near the river for the afternoon?"
    rare = "Could you find a clarinet teacher near the cathedral for the mornings?"
    peaks = {plain: 2.0, rare: 9.0} | {text: 1.0 for text in FILLER}  # the filler asks for things too
    original = Conversation.respond

    def respond_with_set_scores(self, *args, **kwargs):
        reply = original(self, *args, **kwargs)
        for segment in self.segments:  # what the prefill recorded, replaced
            if segment.text in peaks:
                segment.surprisal = [peaks[segment.text]] * len(segment.token_ids)
        return reply

    monkeypatch.setattr(Conversation, "respond", respond_with_set_scores)
    conversation, _ = _request_then_filler(converse, 0.075, [plain, rare])  # 31 tokens: one condensed request
    by_text = {s.text: s for s in conversation.segments}
    costs = [len(by_text[text].summary_ids) + DIGEST_GLUE_TOKENS for text in (plain, rare)]
    assert max(costs) <= 31 < sum(costs)  # the share holds either, not both
    assert by_text[rare].visible and not by_text[plain].visible


def test_a_reply_that_repeats_facts_already_in_the_digest_is_dropped(converse):
    conversation = converse(budget=420, tagging="rules")
    pairs = [("My order number is 88412, shipping to Porto.", "Order 88412 to Porto, noted.")]
    _forced_turns(conversation, pairs + [(text, "we talked about that.") for text in FILLER])
    reply = next(s for s in conversation.segments if s.text == "Order 88412 to Porto, noted.")
    assert reply.status is Status.DROPPED
    assert "88412" in conversation.context and "Porto" in conversation.context


def test_an_offer_that_an_accepted_confirmation_repeats_leaves_first_and_no_fact_is_lost(converse):
    conversation = converse(budget=320, tagging="rules")
    offer = "How about Casa Azul at $85 a night?"
    confirmation = "Booking Casa Azul at $85 a night from May 3rd. Is that right?"
    pairs = [
        ("Find me a guesthouse in Porto.", offer),
        ("Does it have parking?", "It does."),
        ("Then book it from May 3rd.", confirmation),
        ("Yes, that's right.", "Done."),
    ]
    _forced_turns(conversation, pairs + [(text, "we talked about that.") for text in FILLER])
    by_text = {s.text: s for s in conversation.segments}
    assert by_text[offer].status is Status.DROPPED  # everything it says, the confirmation says
    assert by_text[confirmation].visible  # accepted: not dropped as a repeat of the digest
    assert all(fact in conversation.context for fact in ("Casa Azul", "$85", "May 3rd"))


def _verbatim_tail_tokens(recent_share: float, converse) -> int:
    config = LifecycleConfig(tagging=TaggingConfig(mode="signals"), budget=600, recent_share=recent_share)
    conversation = converse(config=config)
    for index in range(24):
        conversation.add("user", f"Order {index}00-ZX goes to gate {index} at {index % 12 + 1}:15 pm, please.")
        conversation.respond(f"Noted order {index}00-ZX.")
    assert conversation.fold > 0 and conversation.context_tokens <= 600
    tail = conversation.history[conversation.fold :]
    return sum(len(conversation.segment(s).visible_ids) for m in tail for s in m.segment_ids)


def test_budget_pressure_keeps_the_newest_messages_verbatim_for_recent_share_of_the_budget(converse):
    kept, legacy = _verbatim_tail_tokens(0.5, converse), _verbatim_tail_tokens(0.0, converse)
    assert kept > legacy  # passes 2-4 may still drop chatter from the tail, by value


def _exchanges(count: int) -> list[tuple[str, str]]:
    """Chit-chat with a fact in every user message and none in the replies."""
    return [
        (f"I walked {index} km along the river to the bakery on Elm Street today.", "That sounds lovely, go on.")
        for index in range(count)
    ]


def test_budget_pressure_keeps_the_newest_messages_whole_and_in_order(converse):
    """The verbatim messages after the digest are the newest ones, every one of them: a
    reply is never dropped from between two user messages to make room (the context
    would read as another conversation), whatever the labels or eviction values say."""
    config = LifecycleConfig(tagging=TaggingConfig(mode="signals"), budget=600)
    conversation = converse(config=config)
    for turn, (user, reply) in enumerate(_exchanges(30), start=1):
        conversation.add("user", user)
        conversation.respond(reply)
        if conversation.fold:
            window = conversation.history[conversation.fold :]
            shown = [all(conversation.segment(s).status is Status.ACTIVE for s in m.segment_ids) for m in window]
            assert all(shown), (turn, shown)
    assert conversation.turn_log[-1].prompt_tokens <= 600 and conversation.fold > 0
    roles = [m.role for m in conversation.history[conversation.fold :]]
    assert all(a != b for a, b in itertools.pairwise(roles)), roles  # still alternating


def test_a_turns_digest_tokens_are_the_digest_messages_tokens_in_its_prompt(converse):
    """``digest_tokens``: 0 while nothing is folded; then the length of the digest message
    ("Notes from earlier turns:", system header to footer) in the prompt the reply read."""
    from clm_middleware.lifecycle.renderer import DIGEST_TITLE

    conversation = converse(config=LifecycleConfig(tagging=TaggingConfig(mode="signals"), budget=600))
    chat = conversation.renderer.format
    title = chat.encode(DIGEST_TITLE)
    header, footer = list(chat.glue["system"].header_ids), list(chat.glue["system"].footer_ids)
    opening = header + list(title)
    seen = []
    for user, reply in _exchanges(30):
        conversation.add("user", user)
        stats = conversation.respond(reply).stats
        prompt = list(conversation.context_ids)  # this turn's prompt (compacted first if it was), then its reply
        starts = [i for i in range(len(prompt)) if prompt[i : i + len(opening)] == opening]
        if not starts:
            assert stats.digest_tokens == 0
            continue
        start = starts[0]
        end = next(i for i in range(start, len(prompt)) if prompt[i : i + len(footer)] == footer) + len(footer)
        assert stats.digest_tokens == end - start
        seen.append(stats.digest_tokens)
    assert seen and all(tokens > 0 for tokens in seen)  # the budget folded some, and it was counted


def test_a_folded_message_whose_words_the_digest_holds_already_is_dropped(converse):
    conversation = converse(budget=420, tagging="rules")
    first, again = "The water and the heating are off.", "The heating and the water are off."
    pairs = [(first, "Sure."), (again, "Sure.")]  # condensed: "water heating", "heating water"
    decisions = []
    for user, reply in pairs + [(text, "we talked about that.") for text in FILLER]:
        conversation.add("user", user)
        decisions += conversation.respond(reply).decisions
    repeat = next(s for s in conversation.segments if s.text == again)
    assert repeat.status is Status.DROPPED
    assert any(d.reason == "duplicate of the digest" and d.segment_id == repeat.id for d in decisions)
    told = next(s for s in conversation.segments if s.text == first)
    assert told.summary == "water heating"  # the first telling was condensed into the digest
    assert not any(d.reason == "duplicate of the digest" and d.segment_id == told.id for d in decisions)


def test_a_turns_render_work_depends_on_the_context_not_on_the_history(converse, monkeypatch):
    from clm_middleware.lifecycle.renderer import ContextRenderer

    conversation = converse(budget=256, max_new_tokens=2)
    seen: list[int] = []
    render = ContextRenderer.render
    monkeypatch.setattr(
        ContextRenderer,
        "render",
        lambda self, messages, *a, **k: seen.append(len(messages)) or render(self, messages, *a, **k),
    )
    widths = []
    for index in range(120):
        seen.clear()
        conversation.add("user", f"Order {index} goes to gate {index % 9}, thanks.")
        conversation.respond(f"Noted order {index}.")
        widths.append(max(seen))
    assert len(conversation.history) == 240 and conversation.fold > 150
    assert max(widths[-20:]) <= max(widths[30:50]) + 8  # bounded by the context, not growing with history


def test_a_prompt_that_fills_the_window_says_so_instead_of_blaming_max_new_tokens(converse, engine):
    from clm_middleware.errors import ContextWindowError

    conversation = converse(tagging="rules", max_new_tokens=8)
    conversation.add("user", "x")
    overhead = len(conversation.render_prompt(None).token_ids) - 1
    conversation.discard(0)
    conversation.add("user", "x" * (engine.max_positions - overhead))
    assert len(conversation.render_prompt(None).token_ids) >= engine.max_positions
    with pytest.raises(ContextWindowError, match=r"fills the model's .* positions: no room is left for a reply"):
        conversation.respond()


def test_a_conversation_reads_as_what_it_is(converse):
    conversation = converse(budget=512, conversation_id="trip-42")
    conversation.send("hello there")
    text = repr(conversation)
    assert text.startswith("Conversation(id='trip-42', turn=1, messages=2, budget=512, tagging='signals', model=")


def test_a_long_segment_of_facts_is_trimmed_to_what_fits_rather_than_dropped_whole(converse):
    """Budget pressure on a pasted list (one long segment of facts): dropping it whole would
    free far more than needed, so it keeps what fits, facts first, and says nothing it did
    not say."""
    # 16 entries: the paste fits the budget when it is sent (over it, the newest message
    # is cut first to fit, a path of its own), and later turns bring the pressure
    entries = ", ".join(
        f"bin {c}{n} holds item X{n * 37}" for c, n in zip("ABCDEFGHJKLMNPQR", range(10, 26), strict=True)
    )
    pasted = "inventory " + entries
    config = LifecycleConfig(tagging=TaggingConfig(mode="rules"), budget=450)
    conversation = converse(config=config)
    _forced_turns(conversation, [(pasted, "Noted."), *((text, "we talked about that.") for text in FILLER)])
    log = next(s for s in conversation.segments if s.text == pasted)
    assert log.visible and log.summary_method == "trimmed"
    kept = log.summary.split()
    assert 0 < len(kept) < len(pasted.split()) and set(kept) <= set(pasted.split())
    assert sum(w[0] == "X" and w[1:].rstrip(",").isdigit() for w in kept) >= 3  # facts, not filler words
    assert conversation.context_tokens <= 450


def test_tools_bound_before_the_first_turn_are_no_format_change_but_later_ones_are(converse):
    conversation = converse(budget=600, tagging="rules")
    conversation.set_tools_prompt("You may call get_weather(city).")
    conversation.add("user", "What is the weather in Porto?")
    assert conversation.respond("Sunny.").stats.compaction == ""  # nothing was computed before it
    conversation.set_tools_prompt("You may call get_weather(city) and get_time(city).")
    conversation.add("user", "And the time?")
    assert conversation.respond("Noon.").stats.compaction == "format"  # the prompt's start moved


def test_a_fork_without_a_budget_regenerates_from_the_context_the_reply_saw(converse):
    """Without a budget labels take effect at the next turn; a client re-sending a history
    to regenerate its last reply (a fork) must not have them applied first: it answers
    from the context that reply saw, as a new conversation given that history would."""
    conversation = converse(config=LifecycleConfig(tagging="rules", min_reclaim_tokens=1))
    conversation.add("user", "My order number is 88412 and it has not arrived yet.")
    for reply, text in [("Let me check.", "ok thanks"), ("Sure.", "ok great"), ("Happy to help.", "Where is it now?")]:
        conversation.add("assistant", reply)
        conversation.add("user", text)
    first = conversation.respond().stats.prompt_tokens
    assert any(s.pending for s in conversation.segments)  # labels decided in the turn wait for the next
    regenerated = conversation.fork(len(conversation.history) - 1).respond()
    assert regenerated.stats.prompt_tokens == first


def test_a_code_block_in_the_digest_opens_and_closes_a_line_of_its_own(converse):
    # joined to the text around it by spaces, "deploy.yaml: ```yaml" is no fence
    conversation = converse(budget=400, tagging="rules")
    code = "```yaml\nreplicas: 3\nimage: payments:v2.4.1\n```"
    conversation.add("user", f"My deploy file for release 2.4.1 is deploy.yaml:\n{code}\nIs that fine for staging?")
    conversation.respond("Looks fine.")
    for text in FILLER:
        conversation.add("user", text)
        conversation.respond("Noted.")
    context = conversation.context
    digest = context[context.index("Notes from earlier turns:") :].split("<|im_end|>")[0]
    assert f"deploy.yaml:\n{code}\n" in digest  # kept whole, never cut, on lines of its own


def test_a_code_block_a_reply_left_open_is_closed_in_the_digest(converse):
    # a reply cut at max_new_tokens inside its code: folded as it is, its fence would make
    # every later digest line read as code
    conversation = converse(budget=520, tagging="rules")
    conversation.add("user", "Write load_rows for rows.csv in Python 3.12, please.")
    cut = "Here is read_csv_rows:\n```python\ndef read_csv_rows(path):\n    with open(path) as fh:"
    conversation.respond(cut)
    for text in FILLER:
        conversation.add("user", text)
        conversation.respond("Noted.")
    context = conversation.context
    digest = context[context.index("Notes from earlier turns:") :].split("<|im_end|>")[0]
    assert cut in digest and digest.count("```") == 2  # closed right after it
    assert f"{cut}\n```\n" in digest or digest.endswith(f"{cut}\n```")


def test_a_tool_result_over_the_budget_keeps_the_request_and_the_call_it_answers(converse):
    """An exchange ends at the assistant's answer, not at its tool call: the request that
    opened it stays verbatim and the result is condensed (a ChatCLM agent loop had lost
    "I have a pet ferret named Bingo. What does the otter eat? Use search." and its call,
    and the model answered "The tool is a tool that helps you find…")."""
    conversation = converse(budget=1024, tagging="rules")
    conversation.add("user", "Hi, I am planning a trip.")
    conversation.respond("Great, where to?")
    question = "My ferret is Bingo. What does the otter eat? Use search."
    call = '<tool_call>{"name": "search", "arguments": {"query": "otter"}}</tool_call>'
    conversation.add("user", question)
    conversation.add("assistant", call)
    conversation.add(
        "tool", " ".join(f"The animal number {i} lives in region {i} and eats food type {i * 7}." for i in range(16))
    )
    reply = conversation.respond("It eats food type 21.")
    assert reply.stats.compaction == "budget" and conversation.context_tokens <= 1024
    context = conversation.context
    assert question in context and call in context
    assert "eats 21" in context or "eats food type 21" in context  # the result condensed, its facts kept


def test_a_long_tool_loop_folds_its_older_results_and_keeps_the_request_whole(converse):
    """Once the running exchange outgrows the budget, its older calls and results fold; the
    request they answer stays whole (folding oldest first had condensed it to "otter fetch,
    otters" and then dropped it as restated by a result, while the calls stayed)."""
    conversation = converse(budget=1024, tagging="rules")
    question = "Read the otter report page by page with fetch, then tell me where the otters sleep."
    conversation.add("user", question)
    call = '<tool_call>{{"name": "fetch", "arguments": {{"page": {}}}}}</tool_call>'
    conversation.respond(call.format(1))
    for page in range(1, 6):
        conversation.add(
            "tool", f"Page {page}. " + " ".join(f"Line {i} of page {page} tells of rivers." for i in range(8))
        )
        reply = conversation.respond(call.format(page + 1))
        assert question in conversation.context, page
        assert reply.stats.prompt_tokens <= 1024
    assert "budget" in [t.compaction for t in conversation.turn_log]  # the loop outgrew the budget


def test_the_users_fact_stays_when_the_newest_tool_result_alone_outgrows_the_mark(converse):
    """Facts in the digest go down to halfway between the low-water mark and the budget;
    when the newest exchange alone (a long tool result of flight codes, which condensing
    cannot shorten) is over the mark, that room buys nothing (the next turn folds the
    result anyway), so facts go only to fit the budget: "my user ID is mia_li_3668" was
    dropped from a prompt that ended 45 tokens under the budget."""
    conversation = converse(budget=1024, tagging="rules")
    conversation.add("user", "Sure, my user ID is mia_li_3668.")
    conversation.respond("Thanks. What would you like to book?")
    conversation.add("user", "A one-way economy flight, just me.")
    conversation.add(
        "assistant", '<tool_call>{"name": "get_user", "arguments": {"user_id": "mia_li_3668"}}</tool_call>'
    )
    conversation.add("tool", " ".join(f"HA{i:03d} 0{i % 10}:30 ${90 + i}" for i in range(53)))
    reply = conversation.respond("I found your flights.")
    assert reply.stats.compaction == "budget" and reply.stats.prompt_tokens <= 1024
    assert '"user_id": "mia_li_3668"' not in conversation.context  # the call made room: its id is gone
    assert "mia_li_3668" in conversation.context  # the user's own words still say it


def test_a_tool_result_among_the_verbatim_messages_folds_before_a_user_fact_is_dropped(converse):
    """The verbatim messages after the digest are kept for the conversation's wording,
    and facts in the digest went first; a tool's result among them is data that the
    digest condenses without losing a fact, so it folds first (a 384-token user record
    kept verbatim had outlived the user's own id, phone and date)."""
    conversation = converse(budget=640, tagging="rules")
    conversation.add("user", "Hi, I'm Mia. My user id is mia_li_3668 and my phone number is 555-0199.")
    conversation.add(
        "assistant", '<tool_call>{"name": "get_user", "arguments": {"user_id": "mia_li_3668"}}</tool_call>'
    )
    conversation.add(
        "tool", " ".join(f"Reservation R{i:02d} is a flight from city {i} to city {i + 1} in May." for i in range(7))
    )
    conversation.add("assistant", "I found your profile, Mia, with seven reservations.")
    conversation.add("user", "Great. Please keep in mind I prefer an aisle seat.")
    conversation.add("assistant", "Noted: an aisle seat.")
    conversation.add("user", "What phone number did I give you?")
    reply = conversation.respond("You gave 555-0199.")
    assert reply.stats.compaction == "budget" and reply.stats.prompt_tokens <= 640
    context = conversation.context
    assert "555-0199" in context.split("<|im_start|>assistant")[0]  # before the reply: in the digest
    assert "mia_li_3668" in context


def test_a_tool_result_of_records_too_long_for_the_budget_is_trimmed_to_whole_leading_records(converse):
    """Condensing keeps every fact, so a result of flight records (every value a code, a
    time or a price) could not shrink, and the turn failed ("the prompt needs 2879
    tokens ... the budget is 1024"); an agent cannot send a shorter result. It is
    trimmed to its leading records, whole, and still parses."""
    records = [
        {"flight_number": f"HAT{i:03d}", "origin": "JFK", "destination": "SEA", "departure": f"{i % 24:02d}:30:00"}
        for i in range(40)
    ]
    conversation = converse(budget=1024, tagging="rules")
    conversation.add("user", "Find me a flight from JFK to SEA on May 20.")
    conversation.add("assistant", '<tool_call>{"name": "search", "arguments": {"date": "2024-05-20"}}</tool_call>')
    conversation.add("tool", json.dumps(records))
    reply = conversation.respond("I found several flights.")
    assert reply.stats.prompt_tokens <= 1024
    shown = conversation.context.split("<|im_start|>tool\n")[1].split("<|im_end|>")[0]
    kept = json.loads(shown)
    assert 0 < len(kept) < len(records) and kept == records[: len(kept)]


@pytest.mark.parametrize("repeated", [False, True])
def test_a_tool_result_of_lines_too_long_for_the_budget_shows_its_leading_lines_whole(converse, repeated):
    """A scan log cut word by word left scan times cut loose from their hubs, and a log
    of one line said sixty times its rarest word sixty times ("Log Log Log ..."): the
    agent called the tool again. It shows its leading lines, whole, each once."""
    conversation = converse(budget=256, tagging="rules")
    conversation.add("user", "Where is order 48213-KX?")
    conversation.add("assistant", '<tool_call>{"name": "track", "arguments": {"order": "48213-KX"}}</tool_call>')
    scans = (
        ["Parcel 48213-KX scanned at the sorting hub.\n"] * 60
        if repeated
        else [f"2024-05-{i % 28 + 1:02d} 10:{i:02d} parcel 48213-KX scanned at hub {i}.\n" for i in range(60)]
    )
    conversation.add("tool", "".join(scans))
    reply = conversation.respond("It is on its way.")
    assert reply.stats.prompt_tokens <= 256
    shown = conversation.context.split("<|im_start|>tool\n")[1].split("<|im_end|>")[0]
    lines = shown.split("\n")
    assert shown and [line + "\n" for line in lines] == list(dict.fromkeys(scans))[: len(lines)]


def test_a_folded_tool_call_leaves_no_raw_call_in_the_digest(converse):
    """A call is machinery: folded, it is dropped, not kept whole as a digest line the
    model would imitate (a call cut off at max_tokens, '<tool_call>{"name":
    "get_reservation_details", "arguments": {"reservation_id": "123456789…', stayed
    there); its result, folded after it, keeps what the call found."""
    conversation = converse(budget=512, tagging="rules")
    conversation.add("user", "Look up reservation NO6JO3 for me.")
    conversation.respond('<tool_call>{"name": "get_reservation", "arguments": {"reservation_id": "1234567890123')
    conversation.add("tool", "Reservation NO6JO3: JFK to SEA on 2024-05-20, seat 14C.")
    conversation.respond("It is JFK to SEA on May 20, seat 14C.")
    for i in range(8):
        conversation.add("user", f"Note {i}: we also talked about the weather and the river walk at length.")
        conversation.respond("Noted, thanks.")
    context = conversation.context
    assert "Notes from earlier turns:" in context and "14C" in context
    assert "<tool_call>" not in context


def _facts_then_a_search(conversation, results: int) -> None:
    conversation.add("user", "Hi, my user ID is zoe_park_4411 and my date of birth is 1987-02-14.")
    conversation.respond("Thanks, Zoe.")
    conversation.add("user", "I always pay with the Visa ending 5521.")
    conversation.respond("Noted: the Visa ending 5521.")
    conversation.add("user", "Please search for flights after 11 AM.")
    conversation.add("assistant", '<tool_call>{"name": "search", "arguments": {"date": "2024-05-20"}}</tool_call>')
    flights = [
        {"flight_number": f"HAT{i:03d}", "departure": f"{6 + i % 18:02d}:00", "price": 100 + i} for i in range(results)
    ]
    conversation.add("tool", json.dumps(flights))


def test_a_newest_tool_result_over_the_budget_is_trimmed_before_any_user_fact_goes(converse):
    """Facts went first, to make room for a result that could not fit anyway, and the
    result was then trimmed far under the budget: every user fact lost at 407 of 640."""
    conversation = converse(budget=640, tagging="rules")
    _facts_then_a_search(conversation, 40)
    reply = conversation.respond("Here are the flights after 11 AM.")
    assert reply.stats.prompt_tokens <= 640
    context = conversation.context
    assert all(fact in context for fact in ("zoe_park_4411", "1987-02-14", "5521"))
    assert json.loads(context.split("<|im_start|>tool\n")[1].split("<|im_end|>")[0])  # the result, trimmed


def test_a_tool_result_over_four_times_the_budget_is_trimmed_not_refused(converse):
    """The bound on oversized input is for what a person wrote; an agent cannot send a
    tool's result in parts, and the loop died with "send the text in parts"."""
    conversation = converse(budget=512, tagging="rules")
    _facts_then_a_search(conversation, 120)
    assert len(conversation.engine.tokenizer.encode(conversation.history[-1].content)) > 4 * 512
    reply = conversation.respond("Here are the flights.")
    assert reply.stats.prompt_tokens <= 512 and "zoe_park_4411" in conversation.context


def test_a_question_naming_a_folded_calls_argument_does_not_bring_the_call_back(converse):
    """Removed segments the new message refers to come back (they share a distinctive
    token); a tool call, dropped once folded, is machinery and stays out (raw calls came
    back into the notes when the user asked "What is my user ID?")."""
    conversation = converse(budget=700, tagging="rules")
    conversation.add("user", "Look up user zoe_park_4411 please.")
    conversation.respond('<tool_call>{"name": "get_user", "arguments": {"user_id": "zoe_park_4411"}}</tool_call>')
    conversation.add("tool", '{"name": "Zoe Park", "membership": "gold"}')
    conversation.respond("You are a gold member, Zoe.")
    [call] = [s for s in conversation.segments if s.text.startswith("<tool_call>")]
    for i in range(12):  # until the compaction that folds the call: removed this round, room to restore it
        conversation.add("user", f"Note {i}: we also talked about the weather and the river walk at length.")
        conversation.respond("Noted, thanks.")
        if call.status.value == "dropped":
            break
    assert call.status.value == "dropped"
    conversation.add("user", "Is zoe_park_4411 still a gold member?")
    reply = conversation.respond("Yes.")
    assert call.id not in reply.stats.restored and "<tool_call>" not in conversation.context


def test_a_call_from_another_thread_while_a_turn_runs_is_refused_and_the_turn_is_untouched(tiny_model, tiny_tok):
    """Two threads sending at once had interleaved their messages and replies (user, user,
    assistant, assistant; the context then showed one message and neither reply)."""
    import threading

    from clm_middleware.engine import Engine
    from clm_middleware.errors import ConversationBusyError

    inside, release = threading.Event(), threading.Event()

    def hold_first_token(generated, logits):
        if not inside.is_set():  # the first token the turn chooses waits until released
            inside.set()
            assert release.wait(30)
        return logits

    engine = Engine(tiny_model, tiny_tok, logits_processors=[hold_first_token])
    conversation = Conversation(engine, max_new_tokens=2, tagging="signals")
    first = threading.Thread(target=conversation.send, args=("from the first thread",))
    first.start()
    try:
        assert inside.wait(30)
        for call in (lambda: conversation.send("from the second"), lambda: conversation.add("user", "x")):
            with pytest.raises(ConversationBusyError, match="another thread"):
                call()
    finally:
        release.set()
        first.join(30)
    history = conversation.history
    assert [m.role for m in history] == ["user", "assistant"] and history[0].content == "from the first thread"
    assert conversation.send("now the second").turn == 2  # free again once the turn ended


def test_pins_that_leave_no_room_are_named_in_the_budget_error_with_the_way_out(converse):
    conversation = converse(budget=200, max_new_tokens=4)
    for number in range(4):
        conversation.send(f"Message {number}: my code is {1000 + number}-ZX. Please remember it carefully.")
    for segment in conversation.segments:
        if segment.role != "system":
            conversation.pin(segment.id)
    with pytest.raises(ContextBudgetError, match="in pinned segments, which never leave") as raised:
        conversation.send("next " * 30)
    assert "forget() a pinned segment" in (raised.value.hint or "")


def test_add_reads_roles_as_the_cli_and_chatclm_spell_them(converse):
    """A helper's sweep: Conversation.add refused 'developer' and 'User', which a replayed
    transcript and ChatCLM accept."""
    conversation = converse()
    for spelled in ("developer", " User ", "human", "function", "AI"):
        conversation.add(spelled, "text")
    assert [m.role for m in conversation.messages] == ["system", "user", "user", "tool", "assistant"]
    with pytest.raises(ConfigError, match="unknown role 'narrator'"):
        conversation.add("narrator", "text")
