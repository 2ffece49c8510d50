"""`clm replay` options for scripts and sampling: --temperature/--top-k/--min-p, --on-error, --json."""

import json

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
