"""`clm replay` through click's runner, on the tiny model."""

import json

import pytest
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
    assert all(t["generated_tokens"] == 0 and t["forced_tokens"] > 0 for t in report["turns"])


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
    # a bench report says how the run was made, as a replay report does
    assert prefix["settings"]["teacher_force"] is True and prefix["settings"]["max_new_tokens"] == 64
    assert {"temperature", "block_size", "repetition_penalty"} <= set(prefix["settings"])


def test_bench_refuses_unknown_modes(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    result = CliRunner().invoke(cli, ["bench", str(path), "--model", "tiny", "--modes", "stateless,warp"])
    assert result.exit_code == 2
    assert "--modes" in result.output


GREETING_FIRST = [
    {"role": "assistant", "content": "Hi! I am the booking bot. How can I help?"},
    {"role": "user", "content": "A table for two."},
    {"role": "user", "content": "At 8 pm, please."},
    {"role": "assistant", "content": "Booked for two at 8 pm."},
    {"role": "tool", "content": '{"status": "confirmed"}'},
    {"role": "assistant", "content": "Confirmed."},
    {"role": "assistant", "content": "Anything else?"},
]


@pytest.mark.parametrize("mode", ["stateless", "prefix", "truncate", "clm"])
@pytest.mark.parametrize("teacher_force", [True, False])
def test_a_history_as_people_have_it_replays_in_every_mode(tmp_path, mode, teacher_force):
    """A greeting first, two user messages in a row, a tool message with no call, two replies in a row."""
    path = write_transcript(tmp_path / "chat.jsonl", GREETING_FIRST)
    report_path = tmp_path / "report.json"
    arguments = ["replay", str(path), "--model", "tiny", "--mode", mode, "--max-new-tokens", "4", "--budget", "400"]
    arguments += ["--tagging", "signals", "--report", str(report_path)]
    result = CliRunner().invoke(cli, arguments + (["--teacher-force"] if teacher_force else []))
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert len(report["turns"]) == 3  # the greeting is context, not a turn
    if teacher_force:
        assert [t["reply"] for t in report["turns"]] == ["Booked for two at 8 pm.", "Confirmed.", "Anything else?"]
        assert all(t["reply_nll"] > 0 and t["forced_tokens"] > 0 for t in report["turns"])
        assert report["totals"]["reply_nll"] > 0 and report["totals"]["generated_replies"] == 0
    else:  # the second reply in a row is kept as recorded: nothing new came for the model to answer
        assert [t["reply_nll"] is None for t in report["turns"]] == [True, True, False]
        assert report["turns"][-1]["reply"] == "Anything else?"
        assert report["totals"]["generated_replies"] == 2


TOOL_CALLING = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": -3}'},
    {"role": "assistant", "content": "It is -3 C in Oslo."},
]


@pytest.mark.parametrize("mode", ["stateless", "prefix", "truncate", "clm"])
def test_a_generated_replay_keeps_recorded_tool_calls_and_generates_the_text_replies(tmp_path, mode):
    """A replay runs no tools: the call the tool result answers stays as recorded."""
    path = write_transcript(tmp_path / "tools.jsonl", TOOL_CALLING)
    report_path = tmp_path / "report.json"
    arguments = ["replay", str(path), "--model", "tiny", "--mode", mode, "--max-new-tokens", "4", "--budget", "400"]
    result = CliRunner().invoke(cli, [*arguments, "--tagging", "signals", "--report", str(report_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    call, answer = report["turns"]
    assert call["reply"] == '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert call["forced_tokens"] > 0 and call["generated_tokens"] == 0
    assert answer["forced_tokens"] == 0 and answer["reply"] != "It is -3 C in Oslo."
    assert report["totals"]["generated_replies"] == 1
    assert call["reply"] in report["final_context"]


def test_teacher_forced_reply_nll_is_the_same_in_every_mode_without_a_budget(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    values = {}
    for mode in ("stateless", "prefix", "clm"):
        report_path = tmp_path / f"{mode}.json"
        arguments = ["replay", str(path), "--model", "tiny", "--mode", mode, "--teacher-force", "--tagging", "signals"]
        result = CliRunner().invoke(cli, [*arguments, "--report", str(report_path)])
        assert result.exit_code == 0, result.output
        values[mode] = [t["reply_nll"] for t in json.loads(report_path.read_text())["turns"]]
    assert values["prefix"] == pytest.approx(values["stateless"], abs=1e-4)
    assert values["clm"] == pytest.approx(values["prefix"], abs=1e-4)


def test_teacher_forced_a_last_user_message_computes_one_token_in_every_mode(tmp_path):
    """The transcript ends with a user message, so the last turn has no reply to force:
    every mode computes its first token only (clm used to generate a whole reply), so
    generated tokens and turn times compare across modes."""
    path = write_transcript(tmp_path / "ends.jsonl", TRANSCRIPT[:-1])
    generated = {}
    for mode in ("stateless", "prefix", "truncate", "clm"):
        report_path = tmp_path / f"{mode}.json"
        arguments = ["replay", str(path), "--model", "tiny", "--mode", mode, "--teacher-force", "--budget", "256"]
        result = CliRunner().invoke(cli, [*arguments, "--max-new-tokens", "24", "--report", str(report_path)])
        assert result.exit_code == 0, result.output
        generated[mode] = json.loads(report_path.read_text())["turns"][-1]["generated_tokens"]
    assert set(generated.values()) == {1}, generated


def test_at_80_columns_without_a_terminal_the_table_fits_whole_and_progress_is_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    path = write_transcript(tmp_path / "chat.jsonl")
    args = ["replay", str(path), "--model", "tiny", "--mode", "clm", "--budget", "256", "--max-new-tokens", "4"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    table = [line for line in result.output.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and all(len(line) <= 80 for line in table)
    header = next(line for line in table if line.startswith("┃"))
    assert [cell.strip() for cell in header.strip("┃").split("┃")][:4] == ["turn", "prompt", "cached", "prefill"]
    assert "…" not in "".join(line for line in table if line.startswith("│"))  # no number cut
    assert "replay: 3/3 turns" in result.output  # a plain progress line, not a silent run


def test_limit_replays_the_first_conversations_and_budget_in_prefix_mode_is_flagged(tmp_path):
    lines = [json.dumps({**m, "conversation_id": cid}) for cid in ("a", "b", "c") for m in TRANSCRIPT[:3]]
    path = tmp_path / "three.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = tmp_path / "r.json"
    args = ["replay", str(path), "--model", "tiny", "--teacher-force", "--limit", "2", "--budget", "256"]
    result = CliRunner().invoke(cli, [*args, "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert "--budget only applies to --mode clm or truncate" in result.output
    assert {t["conversation_id"] for t in json.loads(report.read_text())["turns"]} == {"a", "b"}


def test_a_transcript_with_no_turn_says_so(tmp_path):
    from click.testing import CliRunner

    from clm_middleware.cli.main import cli

    path = tmp_path / "greeting.jsonl"
    path.write_text('{"role": "assistant", "content": "Hello! How can I help?"}\n')
    result = CliRunner().invoke(cli, ["replay", str(path), "--model", "tiny"])
    assert result.exit_code == 0 and "greeting.jsonl: no turn to replay" in result.output


@pytest.mark.parametrize("system", [True, False], ids=["with-system", "no-system"])
def test_declared_tools_are_shown_alike_in_every_mode(tmp_path, system):
    from clm_middleware.cli.setup import LifecycleOptions, build_engine, driver_factory
    from clm_middleware.replay.formats import read_transcripts
    from clm_middleware.replay.runner import ReplayOptions, turn_plan

    spec = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "system", "content": "You are a weather bot."}] if system else []
    messages.append({"role": "user", "content": "Weather in Paris?"})
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"messages": messages, "tools": [spec]}))
    [transcript] = read_transcripts(path)
    engine = build_engine("tiny")
    contexts = {}
    for mode in ("prefix", "truncate", "clm"):
        driver = driver_factory(engine, ReplayOptions(mode=mode), LifecycleOptions(budget=2000, tagging="rules"))(
            transcript
        )
        for message in turn_plan(transcript)[0][0]:
            driver.add(message)
        contexts[mode] = driver.context
        driver.close()
    assert contexts["prefix"] == contexts["truncate"] == contexts["clm"]
    assert "- get_weather(" in contexts["prefix"]
    assert ("You are a weather bot." in contexts["prefix"]) is system


@pytest.mark.parametrize("mode", ["prefix", "truncate", "clm"])
def test_an_answer_only_the_tools_section_holds_is_not_retained(tmp_path, mode):
    """The tools section's example call names "Paris": a probe answered "Paris" counted as
    retained in every mode although no message said it (a helper's probe)."""
    spec = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "What time is it in Oslo?"}, {"role": "assistant", "content": "Noon."}]
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"messages": messages, "tools": [spec]}))
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps([{"question": "Which city?", "answer": "Paris"}, {"question": "?", "answer": "Oslo"}]))
    report = tmp_path / "r.json"
    arguments = ["replay", str(path), "--model", "tiny", "--mode", mode, "--teacher-force", "--probes", str(probes)]
    result = CliRunner().invoke(
        cli, [*arguments, *(["--budget", "2000"] if mode != "prefix" else []), "--report", str(report)]
    )
    assert result.exit_code == 0, result.output
    written = json.loads(report.read_text())
    assert '"city": "Paris"' in written["final_context"]  # the example is shown to the model
    assert written["retention"] == {"retained": 1, "probes": 2, "lost": ["Paris"]}


def test_a_terminated_replay_writes_the_report_of_its_finished_turns(tmp_path):
    """``kill`` / ``timeout`` send SIGTERM: handled as Ctrl-C is (exit 143, not a lost run)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    turns = [
        m
        for n in range(40)
        for m in ({"role": "user", "content": f"Message {n}."}, {"role": "assistant", "content": "Ok."})
    ]
    path = write_transcript(tmp_path / "long.jsonl", turns)
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "clm_middleware.cli.main", "replay", str(path), "--model", "tiny"]
    command += ["--mode", "prefix", "--max-new-tokens", "2", "--json", "--report", str(report_path)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # the first finished turn, then the signal
            line = process.stdout.readline()
            if not line or json.loads(line).get("type") == "turn":
                break
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    report = json.loads(report_path.read_text())
    assert report["complete"] is False and 1 <= len(report["turns"]) < 40


def _replay(*args: str):
    return CliRunner().invoke(cli, ["replay", *args, "--model", "tiny", "--max-new-tokens", "4"])


def test_a_transcript_that_cannot_be_read_leaves_a_failed_report_not_an_old_one(tmp_path):
    report_path = tmp_path / "report.json"
    assert _replay(str(write_transcript(tmp_path / "good.jsonl")), "--report", str(report_path)).exit_code == 0
    good = json.loads(report_path.read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": "hi"}\n{"role": \n')
    result = _replay(str(bad), "--report", str(report_path))
    assert result.exit_code == 1 and "bad.jsonl:2" in result.output
    report = json.loads(report_path.read_text())
    assert report["complete"] is False and report["turns"] == []
    assert "bad.jsonl:2" in report["failures"][0]["error"]
    # every field a reader of reports looks up is there (a KeyError only on this path before)
    assert set(report) == set(good) and set(report["totals"]) == set(good["totals"])
    assert report["final_context"] == "" and report["totals"]["disk_hits"] == 0
    assert report["settings"]["on_error"] == "stop"


def test_a_clm_report_has_its_lifecycle_totals_even_when_no_turn_ran(tmp_path):
    report_path = tmp_path / "report.json"
    system_only = write_transcript(tmp_path / "system.jsonl", TRANSCRIPT[:1])
    assert _replay(str(system_only), "--mode", "clm", "--report", str(report_path)).exit_code == 0
    totals = json.loads(report_path.read_text())["totals"]
    assert totals["turns"] == 0 and totals["compactions"] == {} and totals["dropped_tokens"] == 0


def test_the_json_stream_tells_the_failed_turn_and_the_totals_when_a_replay_stops(tmp_path):
    too_long = write_transcript(tmp_path / "long.jsonl", [{"role": "user", "content": "word " * 3000}])
    result = _replay(str(too_long), "--json", "--teacher-force")
    assert result.exit_code == 1
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["type"] for line in lines] == ["failed_turn", "totals"]
    assert lines[-1]["complete"] is False


@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_the_json_stream_tells_why_a_transcript_could_not_be_read_and_the_totals(tmp_path, on_error):
    """A script following --json had read nothing at all on stdout (the error went to stderr)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": broken\n')
    result = _replay(str(bad), "--json", "--on-error", on_error)
    assert result.exit_code == 1
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["type"] == "skipped_record" and "bad.jsonl:1" in lines[0]["error"]
    assert lines[-1]["type"] == "totals" and lines[-1]["complete"] is False and lines[-1]["turns"] == 0


def test_an_empty_recorded_reply_is_not_counted_as_a_generated_one(tmp_path):
    report_path = tmp_path / "report.json"
    chat = [TRANSCRIPT[1], {"role": "assistant", "content": ""}, TRANSCRIPT[5], TRANSCRIPT[6]]
    path = write_transcript(tmp_path / "empty.jsonl", chat)
    assert _replay(str(path), "--teacher-force", "--report", str(report_path)).exit_code == 0
    report = json.loads(report_path.read_text())
    assert report["turns"][0]["empty_reply"] is True and report["turns"][0]["reply_flags"] == []
    assert report["totals"]["generated_replies"] == 0


def test_a_run_that_fails_before_its_first_turn_leaves_no_earlier_report_behind(tmp_path):
    report_path = tmp_path / "report.json"
    chat = str(write_transcript(tmp_path / "good.jsonl"))
    assert _replay(chat, "--report", str(report_path)).exit_code == 0
    result = CliRunner().invoke(
        cli, ["replay", chat, "--model", str(tmp_path / "no-such-model"), "--report", str(report_path)]
    )
    assert result.exit_code == 1
    assert not report_path.exists()  # the earlier run's report does not stand for this one


def test_a_reader_that_fails_unexpectedly_leaves_no_earlier_report_behind(tmp_path, monkeypatch):
    from clm_middleware.cli import read

    report_path = tmp_path / "report.json"
    chat = str(write_transcript(tmp_path / "good.jsonl"))
    assert _replay(chat, "--report", str(report_path)).exit_code == 0

    def broken(*_args, **_kwargs):
        raise RuntimeError("a reader's own fault")

    monkeypatch.setattr(read, "read_transcripts", broken)
    assert _replay(chat, "--report", str(report_path)).exit_code == 1
    assert not report_path.exists()  # the earlier run's report does not stand for this one


def test_a_content_part_whose_type_is_not_a_string_is_an_error_naming_it_or_skipped(tmp_path):
    path = tmp_path / "parts.jsonl"
    lines = [{"role": "user", "content": [{"type": ["text"], "text": "hello"}]}, {"role": "assistant", "content": "hi"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = _replay(str(path))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert 'parts.jsonl:1: "content[0].type" must be a string' in result.output
    report_path = tmp_path / "report.json"
    assert _replay(str(path), "--on-error", "skip", "--report", str(report_path)).exit_code == 0
    assert json.loads(report_path.read_text())["totals"]["skipped_records"] == 1


def test_every_lifecycle_option_given_to_a_mode_that_ignores_it_is_flagged(tmp_path):
    """--compact-ahead with --mode prefix had run without a word; an option left at its
    default says nothing, and one the mode uses says nothing either."""
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(m) for m in TRANSCRIPT[:3]) + "\n")
    args = ["replay", str(path), "--model", "tiny", "--teacher-force", "--mode", "prefix"]
    result = CliRunner().invoke(cli, [*args, "--compact-ahead", "--tagging", "rules", "--k", "3", "--tenant", "t"])
    assert result.exit_code == 0, result.output
    for flag in ("--compact-ahead", "--tagging", "--k", "--tenant"):
        assert f"{flag} only applies to --mode clm" in result.output
    assert "--compression" not in result.output and "--summarizer" not in result.output
    clm = CliRunner().invoke(cli, [*args[:-1], "clm", "--compact-ahead", "--tagging", "rules"])
    assert clm.exit_code == 0, clm.output
    assert "only applies" not in clm.output


def test_db_in_truncate_mode_is_flagged_as_ignored(tmp_path):
    """Only clm stores its conversations; the warning had said --db applies to truncate too."""
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(m) for m in TRANSCRIPT[:3]) + "\n")
    args = ["replay", str(path), "--model", "tiny", "--teacher-force", "--mode", "truncate", "--budget", "256"]
    result = CliRunner().invoke(cli, [*args, "--db", str(tmp_path / "c.db")])
    assert result.exit_code == 0, result.output
    assert "--db only applies to --mode clm" in result.output and "--budget only" not in result.output
    assert not (tmp_path / "c.db").exists()


def test_an_interrupted_replay_leaves_only_complete_turns_in_its_store(tmp_path, monkeypatch):
    from clm_middleware.conversation import Conversation
    from clm_middleware.store import Store

    turns = [
        m
        for n in range(6)
        for m in ({"role": "user", "content": f"Message {n}."}, {"role": "assistant", "content": "Ok."})
    ]
    path = write_transcript(tmp_path / "chat.jsonl", turns)
    original, calls = Conversation.respond, []

    def interrupted_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what Ctrl-C (and the CLI's SIGTERM handler) raises mid-turn
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Conversation, "respond", interrupted_third)
    db = tmp_path / "chats.db"
    result = CliRunner().invoke(
        cli, ["replay", str(path), "--model", "tiny", "--mode", "clm", "--teacher-force", "--db", str(db)]
    )
    assert result.exit_code != 0
    stored = Store(db).db.query("select role, content from messages order by idx")
    # two answered turns; the third's message, added before the interrupt, was not kept
    assert [(m["role"], m["content"]) for m in stored] == [(t["role"], t["content"]) for t in turns[:4]]


def test_a_transcript_path_of_dash_is_read_from_standard_input(tmp_path):
    report_path = tmp_path / "stdin.json"
    text = "\n".join(json.dumps(m) for m in TRANSCRIPT) + "\n"
    arguments = ["replay", "-", "--model", "tiny", "--mode", "prefix", "--teacher-force", "--report", str(report_path)]
    result = CliRunner().invoke(cli, arguments, input=text)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert [turn["reply"] for turn in report["turns"]] == ["Noted: order 88412.", "You're welcome.", "88412."]


def test_a_transcript_of_user_messages_only_is_a_script_one_turn_each(tmp_path):
    """It had replayed as one turn of every message joined (a sweep's 126-line script)."""
    said = ["Hi there.", "My order is 88412.", "What was my order number?"]
    path = write_transcript(tmp_path / "script.jsonl", [{"role": "user", "content": text} for text in said])
    report_path = tmp_path / "script.json"
    arguments = ["replay", str(path), "--model", "tiny", "--mode", "clm", "--max-new-tokens", "3"]
    result = CliRunner().invoke(cli, [*arguments, "--report", str(report_path)])
    assert result.exit_code == 0, result.output
    turns = json.loads(report_path.read_text())["turns"]
    assert len(turns) == 3 and all(turn["generated_tokens"] >= 1 for turn in turns)


def test_two_outputs_on_one_path_and_a_nameless_transcript_are_clean_usage_errors(tmp_path):
    """A JSON --report over the --db store, or the report under the plot, had replaced one
    with the other; "clm replay ." had raised a traceback (a CLI sweep)."""
    path = write_transcript(tmp_path / "chat.jsonl")
    same, picture = str(tmp_path / "same.out"), str(tmp_path / "same.png")
    base = ["replay", str(path), "--model", "tiny", "--mode", "clm", "--budget", "256"]
    for outputs in (["--db", same, "--report", same], ["--report", picture, "--plot", picture]):
        result = CliRunner().invoke(cli, [*base, *outputs])
        assert result.exit_code == 2 and "give each output its own" in result.output, result.output
    result = CliRunner().invoke(cli, ["replay", ".", "--model", "tiny"])
    assert result.exit_code == 1 and "is a directory" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # one clean line, no traceback


@pytest.mark.parametrize("mode", ["clm", "truncate"])
def test_a_budget_over_the_models_window_is_a_usage_error_naming_it(tmp_path, mode):
    """Every turn had failed on it, and with --on-error skip the replay exited 0 (a CLI sweep)."""
    path = write_transcript(tmp_path / "chat.jsonl")
    arguments = ["replay", str(path), "--model", "tiny", "--mode", mode, "--budget", "1000000", "--on-error", "skip"]
    result = CliRunner().invoke(cli, arguments)
    assert result.exit_code == 2 and "--budget" in result.output and "positions" in result.output, result.output


def test_a_budget_that_leaves_the_window_no_room_for_a_reply_is_warned_of_in_one_line(tmp_path):
    """Budget 1024 on a 1024-token llama-server slot cut every reply near the budget within
    a few tokens (a helper's probe); the tiny model serves 4,096 positions."""
    path = write_transcript(tmp_path / "chat.jsonl")
    base = ["replay", str(path), "--model", "tiny", "--mode", "clm", "--max-new-tokens", "64"]
    result = CliRunner().invoke(cli, [*base, "--budget", "4090"])
    assert result.exit_code == 0 and "warning: budget 4090 leaves" in result.output, result.output
    assert "a budget of 4032 or less leaves it room" in result.output and "Traceback" not in result.output
    assert "warning: budget" not in CliRunner().invoke(cli, [*base, "--budget", "4032"]).output
    # teacher-forced, a turn computes one token: the budget may take the rest
    assert "warning: budget" not in CliRunner().invoke(cli, [*base, "--budget", "4090", "--teacher-force"]).output


def test_a_bench_budget_over_the_models_window_is_a_usage_error_where_a_mode_uses_it(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    bench = ["bench", str(path), "--model", "tiny", "--teacher-force", "--budget", "1000000"]
    result = CliRunner().invoke(cli, [*bench, "--modes", "prefix,clm", "--on-error", "skip"])
    assert result.exit_code == 2 and "--budget" in result.output and "positions" in result.output, result.output
    assert CliRunner().invoke(cli, [*bench, "--modes", "stateless,prefix"]).exit_code == 0  # they ignore it


def test_a_system_prompt_that_cannot_be_added_fails_every_turn_not_only_the_first(tmp_path):
    """Left out after its first failure, the system prompt was gone for the turns after,
    which then ran without it (a CLI sweep: budget 64, a 90-token system block)."""
    system = {"role": "system", "content": "You are a careful travel agent. " * 12}
    path = write_transcript(tmp_path / "sys.jsonl", [system, *TRANSCRIPT[1:]])
    report_path = tmp_path / "sys.json"
    arguments = ["replay", str(path), "--model", "tiny", "--mode", "clm", "--budget", "64", "--on-error", "skip"]
    result = CliRunner().invoke(cli, [*arguments, "--teacher-force", "--report", str(report_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert [f["turn"] for f in report["failures"]] == [1, 2, 3] and report["turns"] == []
    assert all("system block" in f["error"] for f in report["failures"])
