"""`clm replay` options for scripts and sampling: --temperature/--top-k/--min-p, --on-error, --json."""

import json
import re

import pytest
from click.testing import CliRunner

from clm_middleware.cli.main import cli

TRANSCRIPT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "My order number is 88412. Please note it."},
    {"role": "assistant", "content": "Noted: order 88412."},
    {"role": "user", "content": "What was my order number?"},
    {"role": "assistant", "content": "88412."},
]


def write_transcript(path, messages=TRANSCRIPT):
    path.write_text("\n".join(json.dumps(m) for m in messages) + "\n")
    return path


def replay(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["replay", *args, "--model", "tiny", "--max-new-tokens", "4"])
    return result.exit_code, result.stdout, result.stderr


def test_sampling_flags_reach_the_report_and_top_k_1_replays_as_greedy(tmp_path):
    path = write_transcript(tmp_path / "chat.jsonl")
    code, out, _ = replay(str(path), "--report", str(tmp_path / "greedy.json"))
    assert code == 0, out
    sampled = ["--temperature", "0.9", "--top-k", "1", "--min-p", "0.05", "--seed", "3"]
    code, out, _ = replay(str(path), *sampled, "--report", str(tmp_path / "top1.json"))
    assert code == 0, out
    greedy, top1 = (json.loads((tmp_path / name).read_text()) for name in ("greedy.json", "top1.json"))
    settings = top1["settings"]
    assert (settings["temperature"], settings["top_k"], settings["min_p"], settings["seed"]) == (0.9, 1, 0.05, 3)
    assert [t["reply"] for t in top1["turns"]] == [t["reply"] for t in greedy["turns"]]


def test_an_out_of_range_min_p_is_refused_naming_the_option(tmp_path):
    code, _, err = replay(str(write_transcript(tmp_path / "chat.jsonl")), "--min-p", "1.5")
    assert code == 2 and "--min-p" in err


# ------------------------------------------------------------- --on-error

OVERSIZED = [
    {"role": "user", "content": "My order number is 88412."},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "word " * 1500},  # over the tiny model's context window
    {"role": "assistant", "content": "Too long."},
    {"role": "user", "content": "What was my order number?"},
    {"role": "assistant", "content": "88412."},
]


def test_on_error_stop_is_the_default_and_ends_the_replay_at_the_failing_turn(tmp_path):
    path = write_transcript(tmp_path / "long.jsonl", OVERSIZED)
    code, out, err = replay(str(path), "--report", str(tmp_path / "r.json"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and "turn 2" in err
    assert report["complete"] is False and [t["turn"] for t in report["turns"]] == [1]
    assert "prefill" in out and "failed turns (the run stopped)" in out  # as a run that ends prints them


def test_on_error_skip_records_the_failed_turn_with_its_error_and_replays_the_next(tmp_path):
    path = write_transcript(tmp_path / "long.jsonl", OVERSIZED)
    code, out, err = replay(str(path), "--on-error", "skip", "--report", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is True
    assert [t["turn"] for t in report["turns"]] == [1, 3]  # a failed turn keeps its number
    [failure] = report["failures"]
    assert failure["turn"] == 2 and "positions" in failure["error"]
    assert report["totals"]["failed_turns"] == 1 and report["totals"]["turns"] == 2
    # the failed message left nothing behind: turn 3's prompt is turn 1's history plus its own message
    assert report["turns"][1]["prompt_tokens"] < 200
    assert "skipped turn 2" in err
    assert "failed turns (skipped)" in out and "failed: " in out


def test_on_error_skip_goes_past_a_message_over_the_budget_in_clm_mode(tmp_path):
    messages = [*OVERSIZED[:2], {"role": "user", "content": "word " * 600}, *OVERSIZED[3:]]
    path = write_transcript(tmp_path / "budget.jsonl", messages)
    args = ("--mode", "clm", "--tagging", "rules", "--budget", "128", "--on-error", "skip")
    code, _, err = replay(str(path), *args, "--report", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert [t["turn"] for t in report["turns"]] == [1, 3]
    assert "budget" in report["failures"][0]["error"]


def bench(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["bench", *args, "--model", "tiny", "--max-new-tokens", "4"])
    return result.exit_code, result.stdout, result.stderr


def test_a_bench_stopped_by_one_modes_failing_turn_says_why_in_every_modes_report(tmp_path):
    messages = [*OVERSIZED[:2], {"role": "user", "content": "word " * 600}, *OVERSIZED[3:]]
    path = write_transcript(tmp_path / "budget.jsonl", messages)
    args = ("--modes", "prefix,truncate,clm", "--tagging", "rules", "--budget", "128")
    outputs = ("--markdown", str(tmp_path / "bench.md"), "--plot", str(tmp_path / "bench.png"))
    code, _, err = bench(str(path), *args, "--report-dir", str(tmp_path / "out"), *outputs)
    assert code == 1 and "budget" in err
    # the table and plot of the turns that finished, as the reports (none had been written)
    assert "stopped before its end" in (tmp_path / "bench.md").read_text() and (tmp_path / "bench.png").stat().st_size
    for mode in ("prefix", "truncate"):  # they answered turn 2; clm did not, and the bench stopped there
        report = json.loads((tmp_path / "out" / f"{mode}.json").read_text())
        [failure] = report["failures"]
        assert report["complete"] is False and "the clm mode failed at turn 2" in failure["error"], failure
    clm = json.loads((tmp_path / "out" / "clm.json").read_text())
    assert clm["failures"][0]["turn"] == 2 and "budget" in clm["failures"][0]["error"]


def test_a_bench_with_on_error_skip_runs_every_mode_to_the_end_past_one_modes_failing_turn(tmp_path):
    messages = [*OVERSIZED[:2], {"role": "user", "content": "word " * 600}, *OVERSIZED[3:]]
    path = write_transcript(tmp_path / "budget.jsonl", messages)
    args = ("--modes", "prefix,clm", "--tagging", "rules", "--budget", "128", "--on-error", "skip")
    code, _, err = bench(str(path), *args, "--report-dir", str(tmp_path / "out"))
    assert code == 0, err
    prefix = json.loads((tmp_path / "out" / "prefix.json").read_text())
    clm = json.loads((tmp_path / "out" / "clm.json").read_text())
    assert prefix["complete"] and clm["complete"] and prefix["failures"] == []
    assert [t["turn"] for t in prefix["turns"]] == [1, 2, 3] and [t["turn"] for t in clm["turns"]] == [1, 3]
    assert "clm: 1 failure(s) skipped (turns 2)" in err


@pytest.mark.parametrize("mode", ["prefix", "stateless", "clm"])  # truncate keeps an oversized message's tail
def test_on_error_skip_keeps_the_system_prompt_of_a_failed_first_turn(tmp_path, mode):
    # the first turn brings the system prompt; skipping that turn's message must not replay
    # the rest under the model's default system prompt
    big = OVERSIZED[2]
    messages = [{"role": "system", "content": "You are terse and call the user Captain."}, big, OVERSIZED[3], big]
    messages += OVERSIZED[3:]  # two failed turns in a row, then one that runs
    path = write_transcript(tmp_path / "first.jsonl", messages)
    budget = ("--budget", "256", "--tagging", "rules") if mode == "clm" else ()
    code, _, err = replay(
        str(path), "--mode", mode, *budget, "--on-error", "skip", "--report", str(tmp_path / "r.json")
    )
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert [t["turn"] for t in report["turns"]] == [3] and [f["turn"] for f in report["failures"]] == [1, 2]
    assert "call the user Captain" in report["final_context"]
    assert "word word" not in report["final_context"]


def test_on_error_skip_leaves_out_an_unreadable_record_and_says_where(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"role": "user", "content": "hello"})
    path.write_text(good + "\n" + json.dumps({"role": "wizard", "content": "abracadabra"}) + "\n")
    code, _, err = replay(str(path))
    assert code == 1 and "bad.jsonl:2" in err
    code, _, err = replay(str(path), "--on-error", "skip", "--report", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert len(report["turns"]) == 1 and report["totals"]["skipped_records"] == 1
    assert "bad.jsonl:2" in report["failures"][0]["error"] and report["failures"][0]["turn"] is None


def test_on_error_skip_leaves_out_one_bad_conversation_of_a_sharegpt_file(tmp_path):
    path = tmp_path / "many.json"
    hello = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}
    path.write_text(json.dumps([hello, {"conversations": [{"from": "wizard", "value": "?"}]}, hello]))
    code, _, err = replay(str(path), "--format", "sharegpt", "--on-error", "skip", "--report", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert {t["conversation_id"] for t in report["turns"]} == {"many-0", "many-2"}
    assert "$[1].conversations[0].from" in report["failures"][0]["error"]


# ------------------------------------------------------------- --json


def test_json_prints_one_object_per_turn_then_the_totals_and_nothing_else_on_stdout(tmp_path):
    path = write_transcript(tmp_path / "long.jsonl", OVERSIZED)
    code, out, err = replay(str(path), "--json", "--on-error", "skip")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]  # every stdout line is JSON
    assert [line["type"] for line in lines] == ["turn", "failed_turn", "turn", "totals"]
    first = lines[0]
    assert first["turn"] == 1 and first["role"] == "assistant" and isinstance(first["reply"], str)
    for field in ("conversation_id", "prompt_tokens", "cached_tokens", "prefill_tokens", "ttft_s", "reply_flags"):
        assert field in first
    assert lines[1]["turn"] == 2 and "positions" in lines[1]["error"]
    assert lines[2]["cached_tokens"] > 0
    assert lines[3]["turns"] == 2 and lines[3]["failed_turns"] == 1
    assert "replay:" in err  # the progress line, on stderr


def test_chat_json_prints_one_object_per_turn_and_an_error_object_for_a_refused_message():
    script = "hello\n" + "word " * 600 + "\n/stats\nstill here?\n/quit\n"
    result = CliRunner().invoke(
        cli, ["chat", "--model", "tiny", "--max-new-tokens", "4", "--budget", "128", "--json"], input=script
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]  # no prompt, no banner, no table
    assert [line["type"] for line in lines] == ["turn", "error", "turn"]
    first, refused, last = lines
    assert first["turn"] == 1 and first["role"] == "assistant" and isinstance(first["reply"], str)
    for field in ("conversation_id", "prompt_tokens", "cached_tokens", "ttft_s", "reply_flags", "labels"):
        assert field in first
    assert "budget" in refused["error"]
    assert last["turn"] == 2 and last["cached_tokens"] > 0
    assert "turns: " in result.stderr and "conversation" in result.stderr  # /stats and the banner


def test_an_output_path_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from clm_middleware.cli import setup

    def never(**_):
        raise AssertionError("the engine was built before the output paths were checked")

    monkeypatch.setattr(setup, "build_engine", never)
    transcript = write_transcript(tmp_path / "t.jsonl")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [
        (["replay", str(transcript), "--report", str(tmp_path)], "--report", "is a directory"),
        (["replay", str(transcript), "--plot", f"{blocker}/x.png"], "--plot", "is a file"),
        (["bench", str(transcript), "--report-dir", str(blocker)], "--report-dir", "is a file"),
        (["bench", str(transcript), "--markdown", f"{blocker}/deeper/b.md"], "--markdown", "is a file"),
    ]
    for args, option, reason in cases:
        result = CliRunner().invoke(cli, [*args, "--model", "tiny"])
        assert result.exit_code == 2, (args, result.output)
        assert option in result.output and reason in " ".join(result.output.split())


def test_bad_choices_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    from clm_middleware.cli import setup

    monkeypatch.setattr(setup, "build_engine", lambda **_: pytest.fail("the engine was built first"))
    transcript = str(write_transcript(tmp_path / "t.jsonl"))
    cases = [
        (["chat", "--tagging", "bogus"], "--tagging"),
        (["serve", "--tagging", "bogus"], "--tagging"),
        (["eval", "retention", transcript, "--budget", "256", "--tagging", "signals,bogus"], "bogus"),
        (["replay", transcript, "--mode", "truncate"], "the truncate mode needs --budget"),
    ]
    for args, named in cases:
        result = CliRunner().invoke(cli, [*args, "--model", "tiny"])
        assert result.exit_code == 2 and named in result.output, (args, result.output)


def test_clashing_engine_options_are_refused_naming_the_option_before_the_model_loads(tmp_path, monkeypatch):
    """--paged-kv with --approximate-reuse, or a local engine's setting with --engine, had
    failed only once the model had loaded (seconds), naming the field (paged_kv)."""
    from clm_middleware.cli import setup

    monkeypatch.setattr(setup, "build_engine", lambda **_: pytest.fail("the engine was built first"))
    transcript = str(write_transcript(tmp_path / "t.jsonl"))
    remote = ["--engine", "openai:http://127.0.0.1:9/v1"]
    cases = [
        (["replay", transcript, "--paged-kv", "--approximate-reuse", "0.15"], "--paged-kv"),
        (["bench", transcript, "--modes", "prefix,clm", "--paged-kv", "--approximate-reuse", "0.15"], "--paged-kv"),
        (["replay", transcript, *remote, "--paged-kv"], "--paged-kv"),
        (["chat", *remote, "--quantization", "int4"], "--quantization"),
        (["serve", *remote, "--compile-decode"], "--compile-decode"),
    ]
    for args, named in cases:
        result = CliRunner().invoke(cli, [*args, "--model", "tiny"])
        assert result.exit_code == 2 and named in result.output, (args, result.output)
        assert "paged_kv:" not in result.output


def test_a_replay_stopped_by_a_failing_turn_says_why_in_its_report(tmp_path):
    path = write_transcript(tmp_path / "t.jsonl", [*TRANSCRIPT[:3], {"role": "user", "content": "word " * 400}])
    code, _, err = replay(str(path), "--mode", "clm", "--budget", "128", "--report", str(tmp_path / "r.json"))
    assert code == 1 and "budget" in err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is False and len(report["turns"]) == 1
    [failure] = report["failures"]
    assert failure["turn"] == 2 and "budget" in failure["error"]
    # the final context is the last answered turn's: the refused message is not in it
    assert "word word" not in report["final_context"] and TRANSCRIPT[0]["content"] in report["final_context"]


@pytest.mark.parametrize("mode", ["prefix", "clm"])
def test_a_teacher_forced_transcript_ending_on_a_user_message_reports_and_keeps_no_reply(tmp_path, mode):
    path = write_transcript(tmp_path / "t.jsonl", TRANSCRIPT[:4])  # ends on the user's question
    report_path = tmp_path / "r.json"
    code, _, err = replay(str(path), "--mode", mode, "--teacher-force", "--report", str(report_path))
    assert code == 0, err
    report = json.loads(report_path.read_text())
    last = report["turns"][-1]
    assert last["unanswered"] is True and last["reply_flags"] == [] and last["forced_tokens"] == 0
    # the token decoded for TTFT is no reply: neither the report nor the context keeps it
    assert last["reply"] == ""
    after_question = report["final_context"].split(TRANSCRIPT[3]["content"])[-1]
    assert re.sub(r"<[^>]*>|assistant", "", after_question).strip() == "", after_question
    totals = report["totals"]
    assert totals["generated_replies"] == 0 and totals["flagged_replies"] == 0 and totals["reply_flags"] == {}


@pytest.mark.parametrize("mode", ["prefix", "truncate", "clm"])
def test_a_transcript_with_no_user_message_leaves_its_own_system_prompt_and_greeting_in_the_final_context(
    tmp_path, mode
):
    greeting = {"role": "assistant", "content": "Ahoy! What brings you aboard?"}
    path = write_transcript(tmp_path / "t.jsonl", [TRANSCRIPT[0], greeting])
    report_path = tmp_path / "r.json"
    code, _, err = replay(str(path), "--mode", mode, "--budget", "256", "--report", str(report_path))
    assert code == 0, err
    report = json.loads(report_path.read_text())
    assert report["turns"] == []
    context = report["final_context"]
    assert TRANSCRIPT[0]["content"] in context and greeting["content"] in context


@pytest.mark.parametrize("mode", ["prefix", "clm"])
def test_the_report_carries_the_decode_rate_of_generated_replies_and_none_when_forced(tmp_path, mode):
    path = write_transcript(tmp_path / "chat.jsonl")
    code, out, _ = replay(str(path), "--mode", mode, "--report", str(tmp_path / "gen.json"))
    assert code == 0, out
    code, out, _ = replay(str(path), "--mode", mode, "--teacher-force", "--report", str(tmp_path / "tf.json"))
    assert code == 0, out
    generated, forced = (json.loads((tmp_path / name).read_text()) for name in ("gen.json", "tf.json"))
    decoding = [t for t in generated["turns"] if t["generated_tokens"] > 1]
    assert decoding and all(t["decode_s"] > 0 for t in decoding)
    rate = sum(t["generated_tokens"] - 1 for t in decoding) / sum(t["decode_s"] for t in decoding)
    assert generated["totals"]["decode_tokens_per_s"] == pytest.approx(rate)
    assert forced["totals"]["decode_tokens_per_s"] == 0.0
    assert all(t["decode_s"] == 0.0 for t in forced["turns"])


def test_a_teacher_forced_turn_left_unanswered_decodes_one_token_in_no_time(tmp_path):
    """Its one token is the reply's first and last: decode_s is 0, as docs/report.md says
    of every teacher-forced turn (it had held the time the caller took after it)."""
    path = write_transcript(tmp_path / "open.jsonl", [*TRANSCRIPT, {"role": "user", "content": "And tomorrow?"}])
    code, out, _ = replay(str(path), "--teacher-force", "--report", str(tmp_path / "tf.json"))
    assert code == 0, out
    last = json.loads((tmp_path / "tf.json").read_text())["turns"][-1]
    assert last["unanswered"] is True and last["generated_tokens"] == 1 and last["decode_s"] == 0.0


def test_the_report_settings_name_what_rounds_the_numbers_and_the_tenant(tmp_path):
    # a run whose pool stores bf16 (approximate cache hits) must not read as an exact one
    path = write_transcript(tmp_path / "chat.jsonl")
    args = ("--mode", "clm", "--tagging", "rules", "--kv-dtype", "bf16", "--tenant", "t1")
    code, _, err = replay(str(path), *args, "--report", str(tmp_path / "r.json"))
    assert code == 0, err
    settings = json.loads((tmp_path / "r.json").read_text())["settings"]
    assert settings["dtype"] == "float32" and settings["kv_dtype"] == "bfloat16"
    assert settings["pool_blocks"] > 0 and settings["tenant"] == "t1"


def test_a_conversation_that_cannot_be_set_up_fails_its_turns_in_the_report(tmp_path):
    """A protocol prompt over the budget fails when the conversation is made, before any
    turn: the report said complete false with no failure and the error named no turn."""
    path = write_transcript(tmp_path / "chat.jsonl")
    args = ("--modes", "prefix,clm", "--tagging", "free", "--budget", "300")
    code, _, err = bench(str(path), *args, "--report-dir", str(tmp_path / "stop"))
    assert code == 1 and "conversation 'chat', turn 1: the system block (protocol prompt)" in " ".join(err.split())
    clm = json.loads((tmp_path / "stop" / "clm.json").read_text())
    assert [(f["turn"], f["conversation_id"]) for f in clm["failures"]] == [(1, "chat")]
    prefix = json.loads((tmp_path / "stop" / "prefix.json").read_text())
    assert "the clm mode failed at turn 1" in prefix["failures"][0]["error"]
    code, _, err = bench(str(path), *args, "--on-error", "skip", "--report-dir", str(tmp_path / "skip"))
    assert code == 0, err
    clm = json.loads((tmp_path / "skip" / "clm.json").read_text())
    prefix = json.loads((tmp_path / "skip" / "prefix.json").read_text())
    assert [f["turn"] for f in clm["failures"]] == [1, 2] and clm["turns"] == []
    assert [t["turn"] for t in prefix["turns"]] == [1, 2]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["replay", "{t}", "--report", "{t}"], "--report"),
        (["bench", "{t}", "--modes", "prefix,clm", "--markdown", "{t}"], "--markdown"),
        (["eval", "retention", "{t}", "--budget", "256", "--report", "{p}"], "--report"),
        (["eval", "answers", "{t}", "--budget", "256", "--markdown", "{p}"], "--markdown"),
    ],
)
def test_an_output_naming_a_file_the_run_reads_is_refused_and_the_file_kept(tmp_path, args, named):
    transcript = write_transcript(tmp_path / "chat.jsonl")
    probes = tmp_path / "chat.probes.json"  # read by default, beside the transcript
    probes.write_text(json.dumps([{"question": "Where?", "answer": "Lisbon"}]))
    before = {path: path.read_bytes() for path in (transcript, probes)}
    filled = [a.replace("{t}", str(transcript)).replace("{p}", str(probes)) for a in args]
    result = CliRunner().invoke(cli, [*filled, "--model", "tiny"])
    assert result.exit_code == 2 and named in result.output and "is an input of this run" in result.output
    assert {path: path.read_bytes() for path in before} == before
