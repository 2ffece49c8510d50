"""``compact_ahead``: the compaction the next message would need runs after the reply, and
the next turn prefills only what it adds."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from clm_middleware.cli.main import cli
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.config import LifecycleConfig
from clm_middleware.lifecycle.tagging import TaggingConfig

BUDGET = 1200
REPLY = "Noted, that sounds like a good day."


def _hiking_days(count: int) -> list[str]:
    """Messages of one length, each with its own facts: the pressure comes at a steady pace."""
    return [
        f"Day {day}: we hiked {day + 3} km to the lake near Hallstatt and ate at Gasthof {day}." for day in range(count)
    ]


def _replayed(converse, **config):
    conversation = converse(config=LifecycleConfig(tagging=TaggingConfig(mode="signals"), **config))
    for message in _hiking_days(24):
        conversation.add("user", message)
        conversation.respond(REPLY)
    return conversation


def _opening(conversation) -> int:
    """Tokens that open the next user message (the template's header), computed ahead too."""
    return len(conversation.renderer.format.header_ids("user"))


def test_the_compaction_runs_after_the_reply_and_the_next_turn_prefills_only_its_message(converse):
    conversation = _replayed(converse, budget=BUDGET, compact_ahead=True)
    log, opening = conversation.turn_log, _opening(conversation)
    ahead = [i for i, turn in enumerate(log) if turn.compaction == "ahead"]
    assert ahead and all(turn.compaction in ("", "ahead") for turn in log)  # none waits at a turn's start
    followed = [(log[i], log[i + 1]) for i in ahead if i + 1 < len(log) and not log[i + 1].compaction]
    assert followed
    for before, after in followed:
        # the compacted context and the next message's opening, computed ahead (the engine
        # recomputes the last cached token where it scores the first new one)
        assert before.context_tokens + opening - 1 <= after.cached_tokens <= before.context_tokens + opening
    assert max(turn.context_tokens for turn in log) <= BUDGET


def test_a_turn_that_compacts_ahead_reports_its_prompt_and_counts_the_context_it_computed(converse):
    conversation = _replayed(converse, budget=BUDGET, compact_ahead=True)
    log = conversation.turn_log
    turn = next(t for t in log if t.compaction == "ahead")
    assert turn.prompt_tokens == turn.cached_tokens + turn.prefill_tokens <= BUDGET  # the reply's own prompt
    assert turn.ahead_tokens == turn.context_tokens + _opening(conversation)
    assert turn.context_tokens <= BUDGET * 0.75 + 16
    assert 0 < turn.ahead_prefill_tokens <= turn.ahead_tokens
    totals = conversation.stats()  # the hit rate counts what the pool served of both calls
    assert totals["prompt_tokens"] == sum(t.prompt_tokens + t.ahead_tokens for t in log)
    assert totals["prefill_tokens"] == sum(t.prefill_tokens + t.ahead_prefill_tokens for t in log)


def test_without_it_the_same_chat_compacts_at_the_start_of_a_turn(converse):
    log = _replayed(converse, budget=BUDGET).turn_log
    assert {turn.compaction for turn in log} == {"", "budget"}


def test_without_a_budget_nothing_is_compacted_ahead_but_the_next_messages_opening_is_computed(converse, make_engine):
    logs = {}
    for ahead in (False, True):  # each on its own pool: one would serve the other's prompts
        conversation = converse(engine=make_engine(), compact_ahead=ahead)
        for message in _hiking_days(6):
            conversation.add("user", message)
            conversation.respond(REPLY)
        logs[ahead] = conversation.turn_log
    footer = len(conversation.renderer.format.glue["assistant"].footer_ids)  # the reply's end, never fed
    assert all(turn.compaction != "ahead" for turn in logs[True])
    # only what was computed ahead is counted: the reply's last token (never fed), its end
    # and the next message's opening
    computed = footer + _opening(conversation) + 1
    assert all(turn.ahead_tokens == turn.ahead_prefill_tokens == computed for turn in logs[True])
    for plain, early in zip(logs[False][1:], logs[True][1:], strict=True):
        assert early.prompt_tokens == plain.prompt_tokens
        # the next turn recomputes the last cached token anyway, to score the first new one
        assert early.prefill_tokens == plain.prefill_tokens - computed + 1


def test_a_non_boolean_setting_is_refused_naming_it():
    with pytest.raises(ConfigError, match="compact_ahead: must be true or false"):
        LifecycleConfig(budget=BUDGET, compact_ahead="yes")


def test_the_cli_flag_reaches_the_report(tmp_path):
    lines = [{"role": "system", "content": "You are terse."}]
    for message in _hiking_days(16):
        lines += [{"role": "user", "content": message}, {"role": "assistant", "content": REPLY}]
    path = tmp_path / "days.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    args = ["replay", str(path), "--mode", "clm", "--budget", "400", "--teacher-force", "--compact-ahead"]
    result = CliRunner().invoke(
        cli, [*args, "--tagging", "signals", "--model", "tiny", "--report", str(tmp_path / "r.json")]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["settings"]["compact_ahead"] is True
    ahead = [turn for turn in report["turns"] if turn["compaction"] == "ahead"]
    assert ahead and all(turn["ahead_tokens"] > turn["context_tokens"] for turn in ahead)  # + the next opening
    computed = sum(turn["prefill_tokens"] + turn["ahead_prefill_tokens"] for turn in report["turns"])
    assert report["totals"]["prefill_tokens"] == computed


def test_a_failed_computation_ahead_leaves_the_turn_answered_and_the_next_computes_it(converse, monkeypatch):
    conversation = converse(
        config=LifecycleConfig(tagging=TaggingConfig(mode="signals"), budget=BUDGET, compact_ahead=True)
    )
    generate = conversation.engine.generate

    def failing_ahead(prompt, max_new_tokens=128, **kwargs):
        if max_new_tokens == 0 and kwargs.get("hold_blocks"):
            raise RuntimeError("pool exhausted")
        return generate(prompt, max_new_tokens=max_new_tokens, **kwargs)

    monkeypatch.setattr(conversation.engine, "generate", failing_ahead)
    for message in _hiking_days(24):
        conversation.add("user", message)
        conversation.respond(REPLY)
    log = conversation.turn_log
    ahead = [i for i, turn in enumerate(log) if turn.compaction == "ahead"]
    assert ahead and all(log[i].ahead_tokens == 0 for i in ahead)  # compacted, nothing computed ahead
    after = [log[i + 1] for i in ahead if i + 1 < len(log) and not log[i + 1].compaction]
    assert after and all(turn.prefill_tokens > turn.prompt_tokens // 2 for turn in after)  # computed there
    assert len(log) == 24 and max(turn.prompt_tokens for turn in log) <= BUDGET


def test_a_stored_conversation_reloads_with_it(converse, engine, tmp_path):
    from clm_middleware.conversation import Conversation

    conversation = converse(budget=BUDGET, compact_ahead=True, store=str(tmp_path / "c.db"))
    conversation.send("hello there")
    reloaded = Conversation.load(str(tmp_path / "c.db"), conversation.id, engine)
    assert reloaded.config.compact_ahead is True and reloaded.config.budget == BUDGET
