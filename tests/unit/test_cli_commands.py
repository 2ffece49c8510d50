"""Every CLI command through click's runner: formats, plots, chat, stats, errors, interrupts."""

import io
import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from clm_middleware.cli.main import cli

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "My order number is 88412."},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "ok thanks"},
    {"role": "assistant", "content": "Welcome."},
]


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input)


def test_openai_json_with_tool_calls_replays_end_to_end(tmp_path):
    messages = [
        {"role": "user", "content": "Weather in Porto?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Porto"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"weather": "sunny"}'},
        {"role": "assistant", "content": "It is sunny."},
    ]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": messages}))
    report = tmp_path / "r.json"
    result = run("replay", str(path), "--model", "tiny", "--teacher-force", "--quiet", "--report", str(report))
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert [t["reply"] for t in data["turns"]] == [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Porto"}}</tool_call>',
        "It is sunny.",
    ]


def test_sharegpt_many_conversations_replay_through_one_pool(tmp_path):
    conversations = [
        {
            "id": "a",
            "conversations": [
                {"from": "system", "value": "Be brief and kind."},
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "Hello!"},
            ],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "system", "value": "Be brief and kind."},
                {"from": "human", "value": "Hey"},
                {"from": "gpt", "value": "Hi!"},
            ],
        },
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(conversations))
    report = tmp_path / "r.json"
    result = run("replay", str(path), "--model", "tiny", "--teacher-force", "--quiet", "--report", str(report))
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["totals"]["conversations"] == 2
    assert data["turns"][1]["cached_tokens"] > 0  # the shared system prompt hit across conversations


def test_the_bundled_sharegpt_sample_replays_with_format_sharegpt(tmp_path):
    sample = Path(__file__).parents[2] / "examples" / "transcripts" / "bike_repair.sharegpt.json"
    report = tmp_path / "r.json"
    result = run(
        "replay",
        str(sample),
        "--format",
        "sharegpt",
        "--model",
        "tiny",
        "--max-new-tokens",
        "4",
        "--report",
        str(report),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["complete"] is True and data["failures"] == []
    assert [t["conversation_id"] for t in data["turns"]] == ["bike_repair.sharegpt-commuter"] * 5 + [
        "bike_repair.sharegpt-tubeless"
    ] * 3
    assert data["turns"][5]["cached_tokens"] > 0  # the second conversation starts on the shared system prompt


def test_langchain_message_dicts_replay(tmp_path):
    dumped = [
        {"type": "human", "data": {"content": "Add 2 and 3."}},
        {"type": "ai", "data": {"content": "", "tool_calls": [{"name": "add", "args": {"a": 2, "b": 3}, "id": "x"}]}},
        {"type": "tool", "data": {"content": "5", "tool_call_id": "x"}},
        {"type": "ai", "data": {"content": "It is 5."}},
    ]
    path = tmp_path / "lc.json"
    path.write_text(json.dumps(dumped))
    result = run("replay", str(path), "--model", "tiny", "--teacher-force", "--quiet", "--format", "langchain")
    assert result.exit_code == 0, result.output


def test_replay_clm_mode_writes_lifecycle_fields_plot_and_retention(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    (tmp_path / "chat.probes.json").write_text(json.dumps([{"question": "Order?", "answer": "88412"}]))
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    result = run(
        "replay",
        str(path),
        "--model",
        "tiny",
        "--mode",
        "clm",
        "--tagging",
        "rules",
        "--teacher-force",
        "--report",
        str(report),
        "--plot",
        str(plot),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert {
        "decisions",
        "digest_tokens",
        "dropped_tokens",
        "compressed_tokens",
        "summaries",
        "lifecycle_s",
        "pool_blocks_in_use",
    } <= set(data["turns"][0])
    assert data["retention"] == {"retained": 1, "probes": 1, "lost": []}
    assert "88412" in data["final_context"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "facts retained" in result.output


def test_a_clm_replay_reports_the_digest_share_of_its_prompts(tmp_path):
    """``digest_share``: the digest's tokens over the prompt tokens of the turns; printed
    in the totals table too."""
    messages = [{"role": "system", "content": "You are terse."}]
    for index in range(12):
        messages += [
            {"role": "user", "content": f"Order {index}00-ZX goes to gate {index} at {index % 12 + 1}:15 pm, please."},
            {"role": "assistant", "content": f"Noted order {index}00-ZX."},
        ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in messages))
    report = tmp_path / "r.json"
    args = ("replay", str(path), "--model", "tiny", "--mode", "clm", "--tagging", "signals", "--budget", "600")
    result = run(*args, "--teacher-force", "--report", str(report))
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    turns = data["turns"]
    digest = sum(t["digest_tokens"] for t in turns)
    assert digest > 0 and turns[0]["digest_tokens"] == 0  # folded under the budget, not before
    assert data["totals"]["digest_share"] == digest / sum(t["prompt_tokens"] for t in turns)
    assert "digest share of prompts" in result.output


def test_bench_writes_markdown_and_plot_with_clm(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    markdown, plot = tmp_path / "b.md", tmp_path / "b.png"
    result = run(
        "bench",
        str(path),
        "--model",
        "tiny",
        "--teacher-force",
        "--tagging",
        "rules",
        "--markdown",
        str(markdown),
        "--plot",
        str(plot),
    )
    assert result.exit_code == 0, result.output
    assert "stateless ÷ clm" in markdown.read_text()
    assert plot.exists()


def test_every_bench_report_carries_the_disk_totals(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    reports = tmp_path / "reports"
    modes = ["--modes", "prefix,stateless", "--report-dir", str(reports)]
    result = run("bench", str(path), "--model", "tiny", "--teacher-force", *modes)
    assert result.exit_code == 0, result.output
    for mode in ("prefix", "stateless"):
        assert "disk_hits" in json.loads((reports / f"{mode}.json").read_text())["totals"]


def test_errors_are_one_line_with_where_and_what(tmp_path):
    bad_role = tmp_path / "roles.json"
    bad_role.write_text(json.dumps({"conversations": [{"from": "robot", "value": "beep"}]}))
    result = run("replay", str(bad_role), "--model", "tiny")
    assert result.exit_code == 1 and "conversations[0].from: unknown speaker 'robot'" in result.output
    empty = tmp_path / "empty.json"
    empty.write_text("  ")
    result = run("replay", str(empty), "--model", "tiny")
    assert result.exit_code == 1 and "empty" in result.output
    unknown = tmp_path / "x.json"
    unknown.write_text(json.dumps({"hello": 1}))
    result = run("replay", str(unknown), "--model", "tiny")
    assert result.exit_code == 1 and "cannot tell the format" in result.output
    for output in (result.output,):
        assert "Traceback" not in output


def test_a_message_longer_than_the_context_window_is_a_clear_error_naming_the_turn(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"role": "user", "content": "word " * 1500}) + "\n")
    report = tmp_path / "r.json"
    result = run("replay", str(path), "--model", "tiny", "--mode", "prefix", "--report", str(report))
    assert result.exit_code == 1
    assert "turn 1" in result.output and "positions" in result.output
    assert json.loads(report.read_text())["complete"] is False


def test_ctrl_c_writes_the_report_of_finished_turns(tmp_path, monkeypatch):
    from clm_middleware.replay import runner

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    original = runner.PlainChatDriver.respond
    calls = []

    def interrupt_second_turn(self, forced):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, forced)

    monkeypatch.setattr(runner.PlainChatDriver, "respond", interrupt_second_turn)
    report = tmp_path / "r.json"
    result = run("replay", str(path), "--model", "tiny", "--teacher-force", "--report", str(report))
    assert result.exit_code == 130
    data = json.loads(report.read_text())
    assert data["complete"] is False and len(data["turns"]) == 1


def test_an_interrupted_bench_writes_its_own_markdown_and_plot_over_an_earlier_runs(tmp_path, monkeypatch):
    from clm_middleware.replay import runner

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    markdown, plot = tmp_path / "bench.md", tmp_path / "bench.png"
    markdown.write_text("an earlier run's table\n")
    plot.write_bytes(b"an earlier run's figure")

    def interrupt(self, forced):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.PlainChatDriver, "respond", interrupt)
    args = ["bench", str(path), "--model", "tiny", "--teacher-force", "--modes", "stateless,prefix"]
    result = run(*args, "--markdown", str(markdown), "--plot", str(plot))
    assert result.exit_code == 130 and "interrupted" in result.output
    assert "stopped before its end" in markdown.read_text() and plot.read_bytes() != b"an earlier run's figure"


def test_bench_flags_a_lifecycle_option_that_none_of_its_modes_uses(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    args = ["bench", str(path), "--model", "tiny", "--teacher-force", "--modes", "stateless,prefix"]
    result = run(*args, "--compact-ahead")
    assert result.exit_code == 0, result.output
    assert "--compact-ahead only applies to --mode clm" in result.output


def test_chat_shows_decisions_and_runs_every_command(tmp_path):
    db = tmp_path / "chat.db"
    script = "My order is 88412.\n/segments\n/pin 0\n/forget 99\n/stats\nok thanks\n/quit\n"
    result = run(
        "chat",
        "--model",
        "tiny",
        "--max-new-tokens",
        "4",
        "--tagging",
        "signals",
        "--db",
        str(db),
        "--session",
        "s1",
        input=script,
    )
    assert result.exit_code == 0, result.output
    assert "cached" in result.output and "seg_0: pinned" in result.output and "no segment 'seg_99'" in result.output
    resumed = run("chat", "--model", "tiny", "--db", str(db), "--session", "s1", input="/quit\n")
    assert "resumed s1: 4 messages, turn 2" in resumed.output


def test_chat_skips_a_line_that_is_not_utf8_and_survives_a_message_over_its_budget():
    script = b"hello\n\xff\xfe broken\n" + b"word " * 600 + b"\nstill here?\n/stats\n/quit\n"
    result = CliRunner().invoke(
        cli, ["chat", "--model", "tiny", "--max-new-tokens", "4", "--budget", "128"], input=script
    )
    assert result.exit_code == 0, result.output
    assert "not valid UTF-8" in result.output and "budget" in result.output
    assert "turns: 2" in result.output  # hello and "still here?"; the oversize message left nothing


def test_stats_lists_conversations_and_turns(tmp_path):
    db = tmp_path / "s.db"
    run(
        "chat",
        "--model",
        "tiny",
        "--max-new-tokens",
        "4",
        "--tagging",
        "rules",
        "--db",
        str(db),
        "--session",
        "c1",
        input="hello there\nok\n/quit\n",
    )
    listing = run("stats", "--db", str(db))
    assert listing.exit_code == 0 and "c1" in listing.output
    turns = run("stats", "--db", str(db), "--conversation", "c1")
    assert turns.exit_code == 0 and "rules" in turns.output  # a row per turn, decided by rules
    missing = run("stats", "--db", str(db), "--conversation", "nope")
    assert missing.exit_code == 1 and "no conversation 'nope'" in missing.output


def test_stats_turn_by_turn_shows_the_pins_and_forgets_made_after_a_turn(tmp_path):
    db = tmp_path / "s.db"
    script = "My order is 88412.\nok\n/pin 0\n/forget 1\nthanks\n/quit\n"
    chat = ["chat", "--model", "tiny", "--max-new-tokens", "4", "--tagging", "signals", "--db", str(db)]
    assert run(*chat, "--session", "c1", input=script).exit_code == 0
    turns = CliRunner(env={"COLUMNS": "200"}).invoke(cli, ["stats", "--db", str(db), "--conversation", "c1"])
    assert turns.exit_code == 0 and "by user" in turns.output, turns.output
    [second] = [line for line in turns.output.splitlines() if line.startswith("│    2 ")]
    assert "forgotten 1, pinned 1" in second


def test_stats_piped_at_80_columns_shows_every_id_whole(tmp_path, monkeypatch):
    """An id cut to "sgd-test…" cannot be passed to --conversation."""
    monkeypatch.setenv("COLUMNS", "80")
    db = tmp_path / "s.db"
    session = "sgd-test-4_00118-a-long-session-name"
    chat = ("chat", "--model", "tiny", "--max-new-tokens", "4", "--tagging", "rules", "--db", str(db))
    run(*chat, "--session", session, input="hello there\n/quit\n")
    listing = run("stats", "--db", str(db))
    assert listing.exit_code == 0 and session in listing.output and "…" not in listing.output


def test_stats_on_a_damaged_store_names_the_file_or_the_turn_instead_of_a_traceback(tmp_path):
    import sqlite3

    db = tmp_path / "s.db"
    chat = ["chat", "--model", "tiny", "--max-new-tokens", "4", "--db", str(db), "--session", "c1"]
    assert run(*chat, input="hello there\nok\n/quit\n").exit_code == 0
    with sqlite3.connect(db) as connection:
        connection.execute("update turns set stats = 'not json' where turn = 2")
    for args in ([], ["--conversation", "c1"]):
        result = run("stats", "--db", str(db), *args)
        assert result.exit_code == 1 and "conversation 'c1', turn 2: its stored stats are damaged" in result.output
    other = tmp_path / "t.db"
    assert run(*chat[:-4], "--db", str(other), "--session", "c1", input="hi\n/quit\n").exit_code == 0
    with sqlite3.connect(other) as connection:
        connection.execute("drop table decisions")
    result = run("stats", "--db", str(other))
    assert result.exit_code == 1 and "cannot read (no such table: decisions)" in result.output


def test_stats_never_writes_and_refuses_a_file_that_is_not_a_store(tmp_path):
    empty = tmp_path / "z.db"
    empty.write_bytes(b"")
    result = run("stats", "--db", str(empty))
    assert result.exit_code == 1 and "not a clm-middleware store" in result.output
    assert empty.stat().st_size == 0  # not a byte written
    text = tmp_path / "notes.db"
    text.write_text("hello, not sqlite")
    result = run("stats", "--db", str(text))
    assert result.exit_code == 1 and "not a usable SQLite store" in result.output
    assert text.read_text() == "hello, not sqlite"


def test_replay_with_a_disk_cache_reports_disk_totals_and_hits_after_a_restart(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    args = [
        "replay",
        str(path),
        "--model",
        "tiny",
        "--teacher-force",
        "--quiet",
        "--disk-cache-dir",
        str(tmp_path / "kv"),
    ]
    first = tmp_path / "first.json"
    assert run(*args, "--report", str(first)).exit_code == 0
    assert json.loads(first.read_text())["totals"]["disk_writes"] > 0  # spilled at the end
    second = tmp_path / "second.json"
    assert run(*args, "--report", str(second)).exit_code == 0
    totals = json.loads(second.read_text())["totals"]
    assert totals["disk_hits"] > 0 and totals["disk_corrupt"] == 0


def test_eval_retention_reports_every_variant_in_json_and_markdown(tmp_path):
    filler = "we talked about the weather and how nice the walk along the river was."
    messages = [{"from": "human", "value": "My order number is 88412."}, {"from": "gpt", "value": "Noted."}]
    for _ in range(6):
        messages += [{"from": "human", "value": filler}, {"from": "gpt", "value": filler}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"conversations": messages}))
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps([{"question": "Order?", "answer": "88412"}]))
    report, markdown = tmp_path / "r.json", tmp_path / "r.md"
    result = run(
        "eval",
        "retention",
        str(path),
        "--format",
        "sharegpt",
        "--probes",
        str(probes),
        "--budget",
        "160",
        "--tagging",
        "rules,signals",
        "--model",
        "tiny",
        "--report",
        str(report),
        "--markdown",
        str(markdown),
    )
    assert result.exit_code == 0, result.output
    variants = {v["variant"]: v for v in json.loads(report.read_text())["variants"]}
    assert list(variants) == ["clm:rules", "clm:signals", "truncate", "keep-all"]
    assert variants["keep-all"]["retained"] == 1
    assert variants["truncate"]["lost"] == ["88412"]  # the fact is older than the newest messages that fit
    # the lifecycle keeps the order number: a fact is not dropped to reach the low-water mark
    assert variants["clm:rules"]["retained"] == 1
    assert variants["clm:rules"]["context_tokens"] < variants["keep-all"]["context_tokens"]
    text = markdown.read_text()
    assert "| variant | retained |" in text and "- truncate: `88412`" in text


def test_plot_lines_of_coinciding_modes_stay_visible():
    from clm_middleware.cli.plot import line_style

    styles = [line_style(i, 4) for i in range(4)]
    assert len({s["marker"] for s in styles}) == 4 and len({s["color"] for s in styles}) == 4
    widths = [s["linewidth"] for s in styles]
    assert widths == sorted(widths, reverse=True) and widths[-1] >= 1  # each drawn over a wider one


def test_chat_resume_applies_the_flags_given_and_save_exports_json_and_help_lists_commands(tmp_path):
    db, exported = tmp_path / "c.db", tmp_path / "c.json"
    base = ["chat", "--model", "tiny", "--max-new-tokens", "4", "--db", str(db), "--session", "trip"]
    assert run(*base, input="hello there\nok\n/quit\n").exit_code == 0
    resumed = run(*base, "--budget", "300", "--tagging", "signals", input=f"/stats\n/help\n/save {exported}\n/quit\n")
    assert resumed.exit_code == 0, resumed.output
    assert "applied to the resumed conversation: --budget 300, --tagging signals" in resumed.output
    assert "turn: 2" in resumed.output and "turns: 2" in resumed.output  # the stored turns count too
    assert "/pin N" in resumed.output and "exports the conversation" in resumed.output
    saved = json.loads(exported.read_text())
    assert saved["settings"]["budget"] == 300 and saved["settings"]["tagging"] == "signals"
    assert [m["content"] for m in saved["messages"]][:1] == ["hello there"]


def test_a_chat_spills_to_its_disk_cache_at_exit_so_a_resumed_chat_hits_from_disk(tmp_path):
    kv = tmp_path / "kv"
    base = ["chat", "--model", "tiny", "--max-new-tokens", "4", "--db", str(tmp_path / "c.db"), "--session", "s"]
    words = " ".join(f"word{i}" for i in range(60))  # several blocks' worth
    assert run(*base, "--disk-cache-dir", str(kv), input=f"{words}\n").exit_code == 0
    assert list(kv.rglob("*.safetensors"))  # written at exit: the 1 GiB pool had evicted nothing
    resumed = run(*base, "--json", "--disk-cache-dir", str(kv), input="and then?\n")
    assert resumed.exit_code == 0, resumed.output
    turn = next(json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{"))
    assert turn["cached_tokens"] >= 64  # a new process: every cached token came from disk


def test_chat_resume_keeps_the_stored_tenant_unless_one_is_given(tmp_path):
    from clm_middleware.store import Store

    db = tmp_path / "c.db"
    base = ["chat", "--model", "tiny", "--max-new-tokens", "4", "--db", str(db), "--session", "acme"]

    def stored_salt() -> str | None:
        store = Store(db, read_only=True)
        salt = json.loads(store.conversation_row("acme")["settings"]).get("cache_salt")
        store.close()
        return salt

    assert run(*base, "--tenant", "T1", input="hello\n/quit\n").exit_code == 0
    assert run(*base, input="again\n/quit\n").exit_code == 0
    assert stored_salt() == "T1"  # resumed without --tenant: still the tenant's blocks only
    assert run(*base, "--tenant", "T2", input="more\n/quit\n").exit_code == 0
    assert stored_salt() == "T2"


def test_bench_names_an_unknown_mode(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    result = run("bench", str(path), "--model", "tiny", "--modes", "prefix,bogus")
    assert result.exit_code == 2 and "unknown mode bogus" in result.output


def test_chat_survives_a_save_that_cannot_be_written(tmp_path):
    not_a_store = tmp_path / "notes.txt"
    not_a_store.write_text("plain text, not SQLite\n")
    script = f"hello\n/save {not_a_store}/chat.db\n/save {not_a_store}\nstill here?\n/stats\n/quit\n"
    result = run("chat", "--model", "tiny", "--max-new-tokens", "4", input=script)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the console wraps long lines at 80 columns
    assert said.count("/save failed") == 2 and "not a usable SQLite store" in said
    assert "turns: 2" in said  # the chat went on after both failed saves


class _SecondWindow(io.BytesIO):
    """Chat input during which another window continues the stored session, just before
    the second line is read: the chat's next save finds the store moved on."""

    def __init__(self, text: str, db: Path) -> None:
        super().__init__(text.encode())
        self.db, self.lines_read = db, 0

    def readline(self, *args) -> bytes:
        self.lines_read += 1
        if self.lines_read == 2:
            with sqlite3.connect(self.db) as connection:
                connection.execute("UPDATE conversations SET turn = turn + 1")
        return super().readline(*args)


@pytest.mark.parametrize("json_lines", [False, True])
def test_chat_says_why_a_turn_was_not_saved_and_goes_on(tmp_path, json_lines):
    """A save that fails after the reply (another writer, a read-only or full store) is
    told as itself and the chat goes on; it had died on an unrelated 'only unanswered
    messages can be discarded' (a helper's sweep). What is still unsaved when the chat
    ends is said too, and the exit status is 1."""
    db = tmp_path / "c.db"
    base = ["chat", "--model", "tiny", "--max-new-tokens", "3", "--db", str(db), "--session", "x"]
    assert run(*base, input="hello\n/quit\n").exit_code == 0
    flags = ["--json"] if json_lines else []
    result = run(*base, *flags, input=_SecondWindow("second\nthird\nfourth\n/quit\n", db))
    said = " ".join(result.output.split())
    assert said.count("another writer") == 3  # the third and fourth turns, then the save at the end
    assert said.count("the reply stands in this chat, but it was not saved") == 2
    assert "only unanswered messages" not in said and result.exit_code == 1


def test_ctrl_c_during_a_reply_stops_that_reply_and_keeps_the_chat(monkeypatch, tiny_model, tiny_tok):
    from clm_middleware.cli import setup
    from clm_middleware.conversation import Conversation
    from clm_middleware.engine import Engine
    from clm_middleware.models import ScriptedReplies

    reply = [*tiny_tok.encode("Hello there, friend.", add_special_tokens=False), tiny_tok.eos_token_id]
    engine = Engine(tiny_model, tiny_tok, logits_processors=[ScriptedReplies([reply, reply])])
    monkeypatch.setattr(setup, "build_engine", lambda **_: engine)
    original = Conversation.stream

    def interrupted_on_first(self, text, **kwargs):
        inner = original(self, text, **kwargs)
        try:
            for piece in inner:
                if text == "first":
                    raise KeyboardInterrupt  # what the terminal's SIGINT raises in the main thread
                yield piece
        finally:
            inner.close()

    monkeypatch.setattr(Conversation, "stream", interrupted_on_first)
    result = run("chat", "--model", "tiny", "--max-new-tokens", "8", input="first\nsecond\n/stats\n/quit\n")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "interrupted: that message and its reply were not kept" in said
    assert "turns: 1" in said  # the second message, answered after the interrupted first


def test_segments_shows_every_id_whole_at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    message = "My order is 88412 and I need it delivered by Friday at the latest, please."
    result = run("chat", "--model", "tiny", "--max-new-tokens", "4", input=f"{message}\n/segments\n/quit\n")
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    assert rows and all(len(line) <= 80 for line in rows)
    assert [line.split("│")[1].strip() for line in rows] == ["seg_0", "seg_1"]
    assert rows[0].rstrip(" │").endswith("…")  # only the text is cut


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["bench", "{t}", "--model", "tiny", "--modes", "prefix,clm", "--plot", "{d}/plot.txt"], "--plot"),
        (["replay", "{t}", "--model", "tiny", "--plot", "{d}/plot.csv"], "--plot"),
        (["eval", "retention", "{t}", "--model", "tiny", "--tagging", "rules,rules"], "--tagging"),
        (["eval", "planted", "--out", "{d}/same.jsonl", "--probes", "{d}/same.jsonl"], "--probes"),
        (
            ["eval", "generate", "--kind", "chitchat", "--out", "{d}/same.jsonl", "--sources", "{d}/same.jsonl"],
            "--sources",
        ),
        (["eval", "retention", "{d}/missing.jsonl", "--model", "tiny", "--budget", "256"], "TRANSCRIPTS"),
        (["eval", "planted", "--turns", "4", "--facts", "2", "--out", "{d}/p.jsonl"], "--turns"),
    ],
)
def test_options_that_cannot_work_are_usage_errors_naming_the_option_before_any_run(tmp_path, args, named):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    result = run(*(a.format(t=path, d=tmp_path) for a in args))
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "same.jsonl").exists()


def test_a_json_report_is_created_with_the_umask_like_any_other_file(tmp_path):
    import os

    from clm_middleware.replay.report import write_json_atomic

    previous = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "r.json", {"ok": True})
    finally:
        os.umask(previous)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


def test_eval_retention_names_the_variant_a_budget_is_too_small_for(tmp_path):
    """A budget under one tagging mode's protocol prompt failed without saying which variant."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps([{"question": "Order?", "answer": "88412"}]))
    result = run(
        "eval",
        "retention",
        str(path),
        "--probes",
        str(probes),
        "--budget",
        "64",
        "--tagging",
        "constrained",
        "--model",
        "tiny",
    )
    said = " ".join(result.output.split())
    assert result.exit_code != 0 and "chat.jsonl · clm:constrained:" in said, said
    assert "does not show the protocol prompt" in said  # its own hint, kept


MARKUP_LOOKALIKES = "see arr[/i] and :x: [bold]here"


def test_text_that_looks_like_rich_markup_is_shown_as_said_in_replay_and_chat(tmp_path, monkeypatch):
    """Rich reads "[/i]" as a closing tag (a MarkupError after the whole replay) and ":x:"
    as an emoji; a reply or a segment is printed as it was said."""
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"role": "user", "content": "hi"})
        + "\n"
        + json.dumps({"role": "assistant", "content": MARKUP_LOOKALIKES})
        + "\n"
    )
    result = run("replay", str(path), "--model", "tiny", "--teacher-force", "--mode", "prefix")
    assert result.exit_code == 0, result.output
    assert MARKUP_LOOKALIKES in result.output
    result = run("chat", "--model", "tiny", "--max-new-tokens", "4", input=f"{MARKUP_LOOKALIKES}\n/segments\n/quit\n")
    assert result.exit_code == 0, result.output
    assert MARKUP_LOOKALIKES in result.output and "❌" not in result.output


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--allowed-origins", "notaurl"], "--allowed-origins"),
        (["--api-key", ""], "--api-key"),
        (["--device", "bogus"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--approximate-reuse", "0.2", "--paged-kv"], "--paged-kv"),
        (["--host", "bad host!!"], "--host"),
    ],
)
def test_serve_settings_that_cannot_work_are_usage_errors_naming_the_option_before_it_serves(monkeypatch, args, named):
    monkeypatch.setattr("uvicorn.run", _never_serve)
    result = run("serve", "--model", "tiny", "--port", "0", *args)
    assert result.exit_code == 2 and f"Invalid value for {named}" in result.output.replace("'", ""), result.output


def _never_serve(*args, **kwargs):
    raise AssertionError("the server started")


def test_serve_refuses_a_db_that_is_not_a_store_before_it_serves(monkeypatch, tmp_path):
    monkeypatch.setattr("uvicorn.run", _never_serve)
    not_a_store = tmp_path / "chat.jsonl"
    not_a_store.write_text("".join(json.dumps(m) + "\n" for m in CHAT))
    result = run("serve", "--model", "tiny", "--port", "0", "--db", str(not_a_store))
    assert result.exit_code == 1 and "not a usable SQLite store" in result.output


def test_eval_planted_warns_of_probes_beside_its_output_that_are_not_its_own(tmp_path):
    """clm eval retention OUT reads OUT.probes.json by default: left from an earlier run,
    it would judge this session by another's probes."""
    out = tmp_path / "p.jsonl"
    first = run("eval", "planted", "--out", str(out), "--turns", "20", "--facts", "2")
    assert first.exit_code == 0 and "warning" not in first.output
    elsewhere = tmp_path / "mine.probes.json"
    second = run("eval", "planted", "--out", str(out), "--probes", str(elsewhere), "--turns", "20", "--facts", "3")
    assert second.exit_code == 0 and elsewhere.exists()
    assert "warning" in second.output and "p.probes.json is not this session's probes" in second.output
