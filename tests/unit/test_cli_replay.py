"""`clm replay` through click's runner, on the tiny model."""

import json

from click.testing import CliRunner

from clm_middleware.cli.main import cli

TRANSCRIPT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "My order number is 88412. Please note it."},
    {"role": "assistant", "content": "Noted: order 88412."},
    {"role": "user", "content": "ok thanks"},
    {"role": "assistant", "content": "You're welcome."},
    {"role": "user", "content": "What was my order number?"},
    {"role": "assistant", "content": "88412."},
]


def write_transcript(path, messages=TRANSCRIPT):
    path.write_text("\n".join(json.dumps(m) for m in messages) + "\n")
    return path


def test_replay_prints_a_per_turn_table_and_writes_the_report(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    report_path = tmp_path / "out" / "report.json"
    result = CliRunner().invoke(
        cli,
        [
            "replay",
            str(path),
            "--model",
            "tiny",
            "--mode",
            "prefix",
            "--max-new-tokens",
            "4",
            "--report",
            str(report_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "prefill" in result.output and "TTFT" in result.output
    report = json.loads(report_path.read_text())
    assert report["mode"] == "prefix" and report["complete"] is True
    assert len(report["turns"]) == 3
    fields = {
        "turn",
        "prompt_tokens",
        "cached_tokens",
        "prefill_tokens",
        "context_tokens",
        "ttft_s",
        "turn_s",
        "reply",
    }
    assert fields <= set(report["turns"][0])
    assert report["turns"][1]["cached_tokens"] > 0
    assert report["totals"]["prefill_tokens"] == sum(t["prefill_tokens"] for t in report["turns"])


def test_teacher_forced_replies_are_the_transcripts_and_stateless_caches_nothing(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    report_path = tmp_path / "r.json"
    args = [
        "replay",
        str(path),
        "--model",
        "tiny",
        "--mode",
        "stateless",
        "--teacher-force",
        "--quiet",
        "--report",
        str(report_path),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert [t["reply"] for t in report["turns"]] == [
        "Noted: order 88412.",
        "You're welcome.",
        "88412.",
    ]
    assert report["totals"]["cached_tokens"] == 0
    assert all(t["generated_tokens"] == 1 for t in report["turns"])


def test_a_malformed_transcript_is_one_clean_error_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"role": "user", "content": "hi"}\n{"role": "user", "content": \n')
    result = CliRunner().invoke(cli, ["replay", str(path), "--model", "tiny"])
    assert result.exit_code == 1
    assert "bad.jsonl:2: not valid JSON" in result.output
    assert "Traceback" not in result.output


def test_a_missing_model_path_is_one_clean_error_line(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    result = CliRunner().invoke(cli, ["replay", str(path), "--model", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "never downloads" in result.output
    assert "Traceback" not in result.output


def test_bench_runs_modes_interleaved_and_writes_markdown_and_reports(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    markdown = tmp_path / "bench.md"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            str(path),
            "--model",
            "tiny",
            "--modes",
            "stateless,prefix",
            "--teacher-force",
            "--markdown",
            str(markdown),
            "--report-dir",
            str(tmp_path / "reports"),
        ],
    )
    assert result.exit_code == 0, result.output
    text = markdown.read_text()
    assert "| metric | stateless | prefix | stateless ÷ prefix |" in text
    assert "prefill tokens" in text and "Command: `clm" in text
    stateless = json.loads((tmp_path / "reports" / "stateless.json").read_text())
    prefix = json.loads((tmp_path / "reports" / "prefix.json").read_text())
    assert [t["reply"] for t in stateless["turns"]] == [t["reply"] for t in prefix["turns"]]
    assert prefix["totals"]["prefill_tokens"] < stateless["totals"]["prefill_tokens"]


def test_bench_refuses_unknown_modes(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    result = CliRunner().invoke(cli, ["bench", str(path), "--model", "tiny", "--modes", "stateless,warp"])
    assert result.exit_code == 2
    assert "--modes" in result.output
