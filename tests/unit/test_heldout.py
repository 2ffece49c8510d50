"""The held-out discipline: tuning and held-out sessions share no dialogue, and the files are what the code builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from clm_middleware.cli.main import cli
from clm_middleware.evaluation.public import TUNING_DIALOGUES, build_session
from clm_middleware.evaluation.tau import build_tau_session, instruction_probes

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
HELDOUT = ROOT / "examples" / "retention" / "heldout"
SOURCES = {
    "sgd": (DATA / "sgd_50" / "sgd50_index.json", DATA / "sgd_50" / "sgd50_transcripts.jsonl"),
    "multiwoz": (DATA / "multiwoz_50" / "multiwoz50_index.json", DATA / "multiwoz_50" / "multiwoz50_transcripts.jsonl"),
}
TAU = DATA / "tau_bench" / "gpt-4o-airline-8.json"


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("dataset", ["sgd", "multiwoz"])
def test_the_tuning_split_rebuilds_the_tuning_session_files_exactly(dataset):
    session = build_session(dataset, *SOURCES[dataset], split="tuning")
    assert session.dialogue_ids == TUNING_DIALOGUES[dataset]
    assert session.messages == read_jsonl(ROOT / "examples" / "retention" / f"{dataset}_session_10.jsonl")
    probes = json.loads((ROOT / "examples" / "retention" / f"{dataset}_session_10.probes.json").read_text())
    assert [p.as_dict() for p in session.probes] == probes


@pytest.mark.parametrize("dataset", ["sgd", "multiwoz"])
def test_held_out_parts_never_hold_a_tuning_dialogue_nor_each_others(dataset):
    parts = [build_session(dataset, *SOURCES[dataset], split="held-out", seed=13, part=k) for k in range(4)]
    ids = [set(p.dialogue_ids) for p in parts]
    assert all(len(part) == 10 for part in ids)
    assert all(not part & set(TUNING_DIALOGUES[dataset]) for part in ids)
    assert len(set().union(*ids)) == 40  # four disjoint parts cover the 40 held-out dialogues
    with pytest.raises(ValueError, match="part"):
        build_session(dataset, *SOURCES[dataset], split="held-out", seed=13, part=4)


def test_every_bundled_held_out_session_shares_no_dialogue_with_tuning_and_is_rebuilt_from_its_sources():
    tuning = {i for ids in TUNING_DIALOGUES.values() for i in ids}
    sources = sorted(HELDOUT.glob("*.sources.json")) + sorted(HELDOUT.glob("long/*.sources.json"))
    assert len(sources) == 10  # 2 SGD, 2 MultiWOZ, 1 τ-bench, 2 chit-chat, 2 support; long/: 1 chit-chat
    seen: set[str] = set()
    for path in sources:
        origin = json.loads(path.read_text())
        transcript = path.with_name(path.name.removesuffix(".sources.json") + ".jsonl")
        assert not set(origin["dialogues"]) & tuning, path.name
        assert not set(origin["dialogues"]) & seen, path.name  # held-out sessions are disjoint too
        seen |= set(origin["dialogues"])
        if origin.get("dataset") in SOURCES:
            args = {k: origin[k] for k in ("seed", "split", "part")}
            session = build_session(origin["dataset"], *SOURCES[origin["dataset"]], dialogues=origin["count"], **args)
        elif origin.get("dataset") == "tau-airline":
            session = build_tau_session(TAU)
        else:
            from clm_middleware.evaluation.chitchat import chitchat_session
            from clm_middleware.evaluation.support import support_session

            make = {"chitchat": chitchat_session, "support": support_session}[origin["generator"]]
            session = make(
                seed=origin["seed"], user_turns=origin["turns"], facts=origin["facts"], sessions=origin["sessions"]
            )
        assert session.messages == read_jsonl(transcript), path.name
        assert list(session.dialogue_ids) == origin["dialogues"]
        probes = json.loads(transcript.with_name(transcript.stem + ".probes.json").read_text())
        assert [p.as_dict() for p in session.probes] == probes, path.name
    assert (HELDOUT / "README.md").exists()


def test_tau_probes_come_from_the_instruction_and_only_what_the_user_said():
    session = build_tau_session(TAU)
    users = "\n".join(m["content"] for m in session.messages if m["role"] == "user")
    assert session.messages[0]["role"] == "system" and "Airline Agent Policy" not in session.messages[0]["content"]
    assert all(m["role"] in ("system", "user", "assistant") and m["content"] for m in session.messages)
    answers = [p.answer for p in session.probes]
    assert "mia_li_3668" in answers and len(answers) == len({a.casefold() for a in answers})
    assert all(p.retained_in(users) for p in session.probes)
    records = json.loads(TAU.read_text())
    instructions = {str(r["task_id"]): r["info"]["task"]["instruction"] for r in records}
    for probe in session.probes:
        task = probe.question.split("task ", 1)[1].split(",", 1)[0]
        assert probe.answer in instructions[task]


def test_tau_instruction_probes_read_each_value_class_and_date_spellings():
    instruction = (
        "You are ana_ruiz_1234. You fly from Boston to Salt Lake on June 2 after 3pm, via EWR, your 5521 card."
    )
    probes = {p.answer: p for p in instruction_probes(9, instruction)}
    assert set(probes) == {"ana_ruiz_1234", "June 2", "3pm", "EWR", "5521", "Boston", "Salt Lake"}
    assert probes["June 2"].alternatives == ("June 2nd",)
    assert probes["Boston"].question == "In airline task 9, where was the customer flying from?"


def test_session_cli_writes_sources_and_refuses_a_tuning_split_of_tau(tmp_path):
    index, transcripts = SOURCES["sgd"]
    out = tmp_path / "s.jsonl"
    args = ["eval", "session", "--dataset", "sgd", "--index", str(index), "--transcripts", str(transcripts)]
    result = CliRunner().invoke(
        cli,
        [
            *args,
            "--split",
            "held-out",
            "--dialogues",
            "2",
            "--out",
            str(out),
            "--sources",
            str(tmp_path / "s.sources.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "s.probes.json").exists()  # --probes defaults to OUT.probes.json
    origin = json.loads((tmp_path / "s.sources.json").read_text())
    assert origin["split"] == "held-out" and len(origin["dialogues"]) == 2
    tau = ["eval", "session", "--dataset", "tau-airline", "--transcripts", str(TAU), "--split", "tuning"]
    refused = CliRunner().invoke(cli, [*tau, "--out", str(tmp_path / "t.jsonl")])
    assert refused.exit_code != 0 and "--split" in refused.output and "Traceback" not in refused.output
    no_index = CliRunner().invoke(
        cli, ["eval", "session", "--dataset", "sgd", "--transcripts", str(transcripts), "--out", str(out)]
    )
    assert no_index.exit_code != 0 and "--index" in no_index.output


def test_an_answer_counts_as_retained_as_a_whole_word_and_next_to_chinese_or_japanese_text():
    """Chinese and Japanese write no spaces: "航班CA1234在" says "CA1234" (the word test had
    counted every fact of a Chinese chat lost, a helper's sweep); in a spaced script the
    answer must still stand as a whole word."""
    from clm_middleware.evaluation.probes import Probe

    assert Probe("flight", "CA1234").retained_in("我的航班CA1234在明天。")
    assert Probe("hotel", "和平饭店").retained_in("住在和平饭店，两晚。")
    assert Probe("date", "3月5日").retained_in("予約は3月5日です。")
    assert not Probe("code", "1234").retained_in("flight CA1234 tomorrow")
    assert not Probe("name", "Ana").retained_in("Banana bread")


def test_a_built_session_never_replaces_the_dataset_it_reads(tmp_path):
    """--out naming the --transcripts file rewrote the dataset (a CLI sweep)."""
    import shutil

    copied = tmp_path / "airline.json"
    shutil.copy(TAU, copied)
    before = copied.read_bytes()
    args = ["eval", "session", "--dataset", "tau-airline", "--transcripts", str(copied)]
    refused = CliRunner().invoke(cli, [*args, "--out", str(copied)])
    assert refused.exit_code == 2 and "is an input of this run" in refused.output, refused.output
    assert copied.read_bytes() == before
