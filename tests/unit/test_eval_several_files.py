"""`clm eval retention` and `clm eval answers` over several files: a row per file, an OVERALL row."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from clm_middleware.cli.main import cli

FILLER = "we talked about the weather and how nice the walk along the river was."


def write_file(tmp_path, name: str, fact: str, answer: str, fillers: int) -> None:
    messages = [{"role": "user", "content": fact}, {"role": "assistant", "content": "Noted."}]
    for _ in range(fillers):
        messages += [{"role": "user", "content": FILLER}, {"role": "assistant", "content": FILLER}]
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(m) + "\n" for m in messages))
    probes = [{"question": "What was it?", "answer": answer}, {"question": "Topic?", "answer": "weather"}]
    (tmp_path / f"{name}.probes.json").write_text(json.dumps(probes))  # the default FILE.probes.json


def run(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(cli, list(args))  # wide enough for the file column


def retention_by_rules(*files: str, budget: str = "160"):
    """`clm eval retention FILES` on the tiny model, rules tagging, options after FILES."""
    return ["eval", "retention", *files, "--budget", budget, "--tagging", "rules", "--model", "tiny"]


def test_a_file_is_judged_on_its_own_contexts_whatever_the_files_before_it(tmp_path):
    # the first file's last message says the second's answers: judged on the joined final
    # contexts, the second file's truncation had "kept" them, and its context had grown
    write_file(tmp_path, "b", "The gate code is 5521.", "5521", 6)
    first = [
        {"role": "user", "content": "Gate 5521, and the weather was fine."},
        {"role": "assistant", "content": "Ok."},
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(m) + "\n" for m in first))
    (tmp_path / "a.probes.json").write_text(json.dumps([{"question": "Gate?", "answer": "5521"}]))
    alone, after = tmp_path / "alone.json", tmp_path / "after.json"
    b = str(tmp_path / "b.jsonl")
    assert run(*retention_by_rules(b), "--report", str(alone)).exit_code == 0
    assert run(*retention_by_rules(str(tmp_path / "a.jsonl"), b), "--report", str(after)).exit_code == 0
    expected = {v["variant"]: v for v in json.loads(alone.read_text())["variants"]}
    (_, second) = json.loads(after.read_text())["files"]
    for variant in second["variants"]:
        mine = expected[variant["variant"]]
        assert (variant["retained"], variant["context_tokens"]) == (mine["retained"], mine["context_tokens"])
    assert expected["truncate"]["retained"] < 2  # the filler pushed the gate code out


def test_retention_over_two_files_sums_probes_and_keeps_each_files_rows(tmp_path):
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 6)
    write_file(tmp_path, "b", "The gate code is 5521.", "5521", 2)
    report = tmp_path / "r.json"
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    result = run(*retention_by_rules(*files), "--report", str(report), "--markdown", str(tmp_path / "r.md"))
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["transcripts"] == files and data["probes"] == 4
    per_file = {f["transcript"]: {v["variant"]: v for v in f["variants"]} for f in data["files"]}
    overall = {v["variant"]: v for v in data["variants"]}
    assert list(overall) == ["clm:rules", "truncate", "keep-all"]
    for name, variant in overall.items():
        assert variant["retained"] == sum(per_file[f][name]["retained"] for f in files)
        assert variant["probes"] == 4 and variant["retention"] == variant["retained"] / 4
        assert variant["context_tokens"] == sum(per_file[f][name]["context_tokens"] for f in files)
        # reply_nll pools over every file's reply tokens, as one replay of both would
        weights = [(per_file[f][name]["reply_nll"], per_file[f][name]["scored_tokens"]) for f in files]
        assert variant["scored_tokens"] == sum(n for _, n in weights) > 0
        assert variant["reply_nll"] == pytest.approx(sum(x * n for x, n in weights) / variant["scored_tokens"])
    assert overall["keep-all"]["retained"] == 4
    assert per_file[files[0]]["truncate"]["lost"] == ["88412"]  # the long file's fact is out of the window
    assert "OVERALL" in result.output and "a.jsonl" in result.output and "b.jsonl" in result.output
    markdown = (tmp_path / "r.md").read_text()
    assert "| file | variant | retained |" in markdown and "| OVERALL | keep-all | 4/4 (100%) |" in markdown
    assert "- a.jsonl · truncate: `88412`" in markdown


def test_answers_over_two_files_pools_probes_and_closes_the_gap_from_pooled_means(tmp_path):
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 6)
    write_file(tmp_path, "b", "The gate code is 5521.", "5521", 2)
    report = tmp_path / "a.json"
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    result = run(
        "eval",
        "answers",
        *files,
        "--budget",
        "160",
        "--tagging",
        "rules",
        "--max-answer-tokens",
        "2",
        "--model",
        "tiny",
        "--report",
        str(report),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    overall = {v["variant"]: v for v in data["variants"]}
    pooled = {
        name: [a for f in data["files"] for v in f["variants"] if v["variant"] == name for a in v["answers"]]
        for name in overall
    }
    for name, variant in overall.items():
        means = [a["gold_mean_logprob"] for a in pooled[name]]
        assert variant["probes"] == 4 and variant["mean_gold_logprob"] == pytest.approx(sum(means) / 4)
    low, high = overall["truncate"]["mean_gold_logprob"], overall["keep-all"]["mean_gold_logprob"]
    clm = overall["clm:rules"]
    if high > low:
        assert clm["gap_closed"] == pytest.approx((clm["mean_gold_logprob"] - low) / (high - low))
    else:  # the random tiny model may score the long context lower: no gap to close
        assert clm["gap_closed"] is None


def test_probes_given_for_some_files_only_or_missing_next_to_a_file_is_a_clean_error(tmp_path):
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 1)
    write_file(tmp_path, "b", "The gate code is 5521.", "5521", 1)
    (tmp_path / "c.jsonl").write_text((tmp_path / "a.jsonl").read_text())
    a, b, c = (str(tmp_path / f"{n}.jsonl") for n in "abc")
    uneven = run(
        "eval", "retention", a, b, "--probes", str(tmp_path / "a.probes.json"), "--budget", "160", "--model", "tiny"
    )
    assert uneven.exit_code != 0 and "once per transcript" in uneven.output
    missing = run("eval", "answers", a, c, "--budget", "160", "--model", "tiny")
    assert missing.exit_code != 0 and "c.probes.json" in missing.output and "Traceback" not in missing.output
    folder = run("eval", "retention", str(tmp_path), "--budget", "160", "--model", "tiny")
    assert folder.exit_code != 0 and "is a directory, not a transcript" in folder.output
    assert not isinstance(folder.exception, ValueError)


def test_an_eval_table_piped_at_80_columns_is_printed_whole(capsys):
    from clm_middleware.cli.eval_variants import print_table

    header = ["file", "variant", "retained", "reply nll", "lifecycle share", "signals share", "invented"]
    row = ["a.jsonl", "clm:rules", "3/5", "2.1", "5.6%", "", "0 in 0 compressed"]
    print_table("retention", header, [row])
    lines = capsys.readouterr().out.splitlines()
    assert all(column in lines[2] for column in header) and "0 in 0 compressed" in lines[4]
    assert all(line.rstrip()[-1] in "┓┃┩│┘" for line in lines[1:])


def _two_conversations(tmp_path):
    """One JSONL file of two conversations (each line names its own), a fact in each."""
    lines = [
        {"conversation_id": "a", "role": "user", "content": "My dog is called Biscuit."},
        {"conversation_id": "a", "role": "assistant", "content": "Noted."},
        {"conversation_id": "b", "role": "user", "content": "I fly to Porto tomorrow."},
        {"conversation_id": "b", "role": "assistant", "content": "Noted."},
    ]
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    probes = [{"question": "Dog?", "answer": "Biscuit"}, {"question": "Where to?", "answer": "Porto"}]
    (tmp_path / "two.probes.json").write_text(json.dumps(probes))
    return path


def test_retention_of_a_file_of_several_conversations_reads_every_conversations_context(tmp_path):
    path, report = _two_conversations(tmp_path), tmp_path / "r.json"
    args = ["eval", "retention", str(path), "--budget", "512", "--tagging", "rules", "--model", "tiny"]
    result = run(*args, "--report", str(report))
    assert result.exit_code == 0, result.output
    variants = {v["variant"]: v for v in json.loads(report.read_text())["variants"]}
    assert variants["keep-all"]["retained"] == 2 and variants["clm:rules"]["retained"] == 2


def test_answers_refuses_a_file_of_several_conversations_naming_it(tmp_path):
    path = _two_conversations(tmp_path)
    result = run("eval", "answers", str(path), "--budget", "512", "--tagging", "rules", "--model", "tiny")
    assert result.exit_code == 2 and "holds 2 conversations" in result.output


def test_a_run_that_fails_on_a_later_file_replaces_earlier_runs_outputs_with_what_finished(tmp_path):
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 1)
    overlong = [{"role": "user", "content": "word " * 5000}, {"role": "assistant", "content": "ok"}]
    (tmp_path / "broken.jsonl").write_text("".join(json.dumps(m) + "\n" for m in overlong))  # read, then fails
    (tmp_path / "broken.probes.json").write_text(json.dumps([{"question": "q", "answer": "word"}]))
    report, markdown = tmp_path / "r.json", tmp_path / "r.md"
    report.write_text('{"an earlier run": true}')
    markdown.write_text("an earlier run's table")
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "broken.jsonl")]
    result = run(*retention_by_rules(*files), "--report", str(report), "--markdown", str(markdown))
    assert result.exit_code == 1 and "broken.jsonl" in result.output
    data = json.loads(report.read_text())  # the earlier run's report is gone: this run's is what finished
    assert [v["variant"] for v in data["variants"]] == ["truncate"]  # a 25,000-token message truncated
    assert [f["variant"] for f in data["failed"]] == ["clm:rules", "keep-all"]
    assert "an earlier run" not in markdown.read_text()


def test_a_probe_whose_answer_the_transcript_never_says_is_warned_about(tmp_path):
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 1)
    probes = [{"question": "Order?", "answer": "88412"}, {"question": "Pet?", "answer": "Biscuit"}]
    (tmp_path / "a.probes.json").write_text(json.dumps(probes))
    result = run(*retention_by_rules(str(tmp_path / "a.jsonl")))
    assert result.exit_code == 0, result.output
    assert "1 probe answer(s) never said" in result.output and "'Biscuit'" in result.output


def test_files_of_one_name_in_two_folders_are_told_apart_in_the_table_and_markdown(tmp_path):
    for folder, fact, answer in (
        ("june", "My order number is 88412.", "88412"),
        ("july", "The gate code is 5521.", "5521"),
    ):
        (tmp_path / folder).mkdir()
        write_file(tmp_path / folder, "chat", fact, answer, 1)
    markdown = tmp_path / "r.md"
    files = [str(tmp_path / "june" / "chat.jsonl"), str(tmp_path / "july" / "chat.jsonl")]
    result = run(*retention_by_rules(*files), "--markdown", str(markdown))
    assert result.exit_code == 0, result.output
    assert "june/chat.jsonl" in result.output and "july/chat.jsonl" in result.output
    text = markdown.read_text()
    assert "| june/chat.jsonl | keep-all |" in text and "| july/chat.jsonl | keep-all |" in text


def test_file_labels_lengthen_only_clashing_names():
    from pathlib import Path

    from clm_middleware.cli.eval_variants import file_labels

    paths = [Path("runs/a/x.jsonl"), Path("runs/b/x.jsonl"), Path("runs/a/y.jsonl"), Path("runs/a/x.jsonl")]
    assert file_labels(paths) == ["a/x.jsonl", "b/x.jsonl", "y.jsonl", "a/x.jsonl"]
    assert file_labels([Path("x.jsonl"), Path("d/x.jsonl")]) == ["x.jsonl", "d/x.jsonl"]


def test_a_variant_that_fails_is_left_out_and_the_others_are_reported(tmp_path):
    """At a budget under the protocol prompt `clm:free` fails; the other variants finish,
    their table, report and markdown are written, the failure is named in each, and the
    command exits 1."""
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 2)
    write_file(tmp_path, "b", "The gate code is 5521.", "5521", 1)
    report, markdown = tmp_path / "r.json", tmp_path / "r.md"
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    args = ["eval", "retention", *files, "--budget", "160", "--tagging", "rules,free", "--model", "tiny"]
    result = run(*args, "--report", str(report), "--markdown", str(markdown))
    assert result.exit_code == 1
    assert "a.jsonl · clm:free: conversation 'a', turn 1: the system block (protocol prompt)" in " ".join(
        result.output.split()
    )
    assert "b.jsonl · clm:free …" not in result.output  # not run again on the next file
    data = json.loads(report.read_text())
    assert [v["variant"] for v in data["variants"]] == ["clm:rules", "truncate", "keep-all"]
    assert all([v["variant"] for v in f["variants"]] == ["clm:rules", "truncate", "keep-all"] for f in data["files"])
    assert [(f["transcript"], f["variant"]) for f in data["failed"]] == [(files[0], "clm:free")]
    assert "Failed (left out of every row):" in markdown.read_text()


def test_answers_without_a_failed_baseline_leaves_gap_closed_empty():
    from clm_middleware.evaluation.answers import AnswersResult, close_gaps

    results = [AnswersResult(name="clm:rules", context_tokens=1, answers=[]), AnswersResult("keep-all", 1, [])]
    close_gaps(results, truncate="truncate", keep_all="keep-all")
    assert results[0].gap_closed is None


@pytest.mark.parametrize(
    ("probe", "said"),
    [({"answer": "5521"}, "no question to ask"), ({"question": 7, "answer": "5521"}, '"question" must be a string')],
)
def test_eval_answers_refuses_a_probe_it_cannot_ask(tmp_path, probe, said):
    write_file(tmp_path, "b", "The gate code is 5521.", "5521", 1)
    probes = tmp_path / "bad.probes.json"
    probes.write_text(json.dumps([probe]))
    args = ["eval", "answers", str(tmp_path / "b.jsonl"), "--probes", str(probes), "--budget", "160", "--model", "tiny"]
    result = run(*args)
    assert result.exit_code != 0 and said in result.output, result.output


@pytest.mark.parametrize("command", ["retention", "answers"])
def test_a_run_whose_file_cannot_be_read_leaves_no_earlier_runs_report(tmp_path, command):
    """An unreadable second file failed the run before the old --report was removed, so it
    stayed beside the failure, as if of these files (a CLI sweep)."""
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 1)
    (tmp_path / "bad.jsonl").write_text('{"role": "user", "content": "hi"}\nnot json\n')
    (tmp_path / "bad.probes.json").write_text(json.dumps([{"question": "q", "answer": "hi"}]))
    report = tmp_path / "r.json"
    report.write_text('{"an earlier run": true}')
    files = [str(tmp_path / "a.jsonl"), str(tmp_path / "bad.jsonl")]
    result = run("eval", command, *files, "--model", "tiny", "--budget", "160", "--report", str(report))
    assert result.exit_code != 0 and "bad.jsonl" in result.output, result.output
    assert not report.exists()


@pytest.mark.parametrize("command", ["retention", "answers"])
def test_an_eval_budget_over_the_models_window_is_a_usage_error_naming_it(tmp_path, command):
    """As in clm replay: each file had failed on it, turn by turn, instead."""
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 1)
    result = run("eval", command, str(tmp_path / "a.jsonl"), "--budget", "1000000", "--model", "tiny")
    assert result.exit_code == 2 and "--budget" in result.output and "positions" in result.output, result.output


@pytest.mark.parametrize("command", ["retention", "answers"])
def test_a_transcript_given_twice_is_a_usage_error_not_counted_twice(tmp_path, command):
    write_file(tmp_path, "a", "My order number is 88412.", "88412", 1)
    a = str(tmp_path / "a.jsonl")
    result = run("eval", command, a, str(tmp_path / "." / "a.jsonl"), "--budget", "160", "--model", "tiny")
    assert result.exit_code == 2 and "given twice" in result.output and "TRANSCRIPTS" in result.output, result.output
