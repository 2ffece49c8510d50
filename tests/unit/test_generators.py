"""The chit-chat and support generators: seeded, facts said once in passing, asked back much later."""

from __future__ import annotations

import json

import pytest
import regex
from click.testing import CliRunner

from clm_middleware.cli.main import cli
from clm_middleware.evaluation import chitchat_words, support_words
from clm_middleware.evaluation.chitchat import chitchat_session
from clm_middleware.evaluation.support import support_session

GENERATORS = [chitchat_session, support_session]


@pytest.mark.parametrize("make", GENERATORS)
def test_a_seed_gives_the_same_session_and_another_seed_a_different_one(make):
    assert make(seed=3) == make(seed=3)
    assert make(seed=3).messages != make(seed=4).messages


@pytest.mark.parametrize("make", GENERATORS)
@pytest.mark.parametrize("seed", range(12))
def test_every_answer_lives_in_exactly_one_long_message_and_is_asked_back_later(make, seed):
    session = make(seed=seed)
    contents = [m["content"] for m in session.messages]
    for probe in session.probes:
        holders = [i for i, text in enumerate(contents) if probe.retained_in(text)]
        assert len(holders) == 1, probe.answer
        stated = contents[holders[0]]
        assert len(regex.findall(r"[.!?](?:\s|$)", stated)) >= 2  # in passing: never a message of its own
    user_turns = [m for m in session.messages if m["role"] == "user"]
    assert len(session.probes) >= 14 and len({p.answer.casefold() for p in session.probes}) == len(session.probes)
    assert 180 <= len(session.messages) <= 220 and len(user_turns) >= 90


def test_chitchat_runs_over_several_sessions_and_has_lowercase_facts():
    session = chitchat_session(seed=1)
    headers = [m["content"].split(" —", 1)[0] for m in session.messages if m["content"].startswith("Session ")]
    assert headers == ["Session 1", "Session 2", "Session 3", "Session 4"]
    assert any(p.answer.islower() for p in session.probes)  # a pet's name, a hobby: no capital to find it by
    name = session.probes[0].question.split("'s ")[0].split()[-1] if "'s " in session.probes[0].question else None
    text = session.text()
    assert name is None or name in text  # the probes ask about a person the chat names


def test_a_recall_question_comes_at_least_a_quarter_of_the_chat_after_its_fact():
    session = chitchat_session(seed=5, user_turns=100)
    users = [m["content"] for m in session.messages if m["role"] == "user"]
    recalls = [question for fact in chitchat_words.FACTS for question in fact[3]]
    asked = [i for i, text in enumerate(users) for question in recalls if text.endswith(question)]
    assert len(asked) == len(session.probes)
    assert min(asked) >= 60  # the recall window is the last 40% of user turns


@pytest.mark.parametrize(
    "pools",
    [
        (chitchat_words.THOUGHTS, chitchat_words.ACTIVITIES, chitchat_words.REACTIONS, chitchat_words.QUESTIONS),
        (support_words.SYMPTOMS, support_words.CONTEXT, support_words.EXPLANATIONS, support_words.AGENT_QUESTIONS),
    ],
)
def test_filler_holds_no_digit(pools):
    assert not any(regex.search(r"\d", sentence) for pool in pools for sentence in pool)


def test_chitchat_fact_pools_are_disjoint_and_never_in_filler():
    values = [v.casefold() for fact in chitchat_words.FACTS for v in fact[1]]
    assert len(values) == len(set(values))
    filler = " ".join(
        [*chitchat_words.THOUGHTS, *chitchat_words.ACTIVITIES, *chitchat_words.RESPONSES, *chitchat_words.QUESTIONS]
    ).casefold()
    assert not [v for v in values if regex.search(rf"(?<!\w){regex.escape(v)}(?!\w)", filler)]


def test_too_few_turns_for_the_facts_is_a_value_error_naming_turns():
    with pytest.raises(ValueError, match="turns"):
        chitchat_session(user_turns=20, facts=15)
    with pytest.raises(ValueError, match="facts"):
        support_session(facts=99)


def test_generate_cli_writes_transcript_probes_and_sources(tmp_path):
    out = tmp_path / "chat.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            "generate",
            "--kind",
            "support",
            "--seed",
            "2",
            "--out",
            str(out),
            "--sources",
            str(tmp_path / "chat.sources.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    probes = json.loads((tmp_path / "chat.probes.json").read_text())
    assert [p["answer"] for p in probes] == [p.answer for p in support_session(seed=2).probes]
    assert json.loads((tmp_path / "chat.sources.json").read_text())["generator"] == "support"
    bad = CliRunner().invoke(cli, ["eval", "generate", "--kind", "chitchat", "--turns", "20", "--out", str(out)])
    assert bad.exit_code != 0 and "turns" in bad.output and "Traceback" not in bad.output
