"""``clm eval answers``: probe questions asked of each variant's final context, on the tiny model."""

import json
import re

import pytest
import torch
from click.testing import CliRunner

from clm_middleware.cli.main import cli
from clm_middleware.cli.setup import LifecycleOptions, driver_factory
from clm_middleware.evaluation.answers import contains_answer, gap_closed, gold_mean_logprob, question_prompt
from clm_middleware.render import ChatFormat
from clm_middleware.replay.report import ReplayReport
from clm_middleware.replay.runner import ReplayOptions, replay
from clm_middleware.replay.transcript import Message, Transcript

FILLER = "we talked about the weather and how nice the walk along the river was."


def chat_messages() -> list[dict[str, str]]:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "My order number is 88412."},
        {"role": "assistant", "content": "Noted."},
    ]
    for turn in range(4):
        messages += [{"role": "user", "content": f"{FILLER} ({turn})"}, {"role": "assistant", "content": "Yes."}]
    return messages


def direct_mean_logprob(model, prompt: list[int], answer: list[int]) -> float:
    """One full forward of prompt + answer, no cache: the reference the engine must match."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
    return float(logprobs[positions, torch.tensor(answer)].mean())


def test_gold_mean_logprob_equals_a_full_forward_with_or_without_the_prompt_in_the_pool(engine, tiny_model):
    chat_format = ChatFormat.from_tokenizer(engine.tokenizer)
    context = chat_format.render(
        [("system", chat_format.encode("You are terse.")), ("user", chat_format.encode("My code is 88412."))],
        add_generation_prompt=False,
    )
    prompt = question_prompt(chat_format, context, "What is my code?")
    assert prompt[: len(context)] == context and prompt[-len(chat_format.generation_prompt_ids) :] == list(
        chat_format.generation_prompt_ids
    )
    answer, other = chat_format.encode("88412"), chat_format.encode("It is 88412")
    expected = direct_mean_logprob(tiny_model, prompt, answer)
    assert gold_mean_logprob(engine, prompt, [answer]) == pytest.approx(expected, abs=1e-4)
    engine.generate(prompt, max_new_tokens=2, use_pool=True).result()  # now the prompt's blocks are cached
    assert engine.pool.stats().blocks_in_use == 0
    assert gold_mean_logprob(engine, prompt, [answer]) == pytest.approx(expected, abs=1e-4)
    best = max(expected, direct_mean_logprob(tiny_model, prompt, other))
    assert gold_mean_logprob(engine, prompt, [answer, other]) == pytest.approx(best, abs=1e-4)


def test_a_greedy_hit_ignores_case_and_whitespace_runs():
    assert contains_answer("Your code is\n  Alpha   Seven.", ["alpha seven"])
    assert contains_answer("none here", ["x", "HERE"])
    assert not contains_answer("alphaseven", ["alpha seven"])
    assert not contains_answer("anything", ["  "])


def test_gap_closed_is_none_when_the_baselines_tie_or_keep_all_is_below_truncation():
    assert gap_closed(-2.0, -3.0, -1.0) == pytest.approx(0.5)
    assert gap_closed(-2.0, -1.5, -1.5) is None
    assert gap_closed(-2.0, -1.0, -3.0) is None  # keep-all below truncation: nothing to close
    assert gap_closed(None, -3.0, -1.0) is None


def replay_driver(engine, mode: str, budget: int | None = None):
    lifecycle = LifecycleOptions(budget=budget, tagging="rules")
    transcript = Transcript("c1", tuple(Message(m["role"], m["content"]) for m in chat_messages()))
    options = ReplayOptions(mode=mode, teacher_force=True)
    replay(
        [transcript],
        driver_factory(engine, options, lifecycle),
        ReplayReport(mode=mode, model="tiny"),
        teacher_force=True,
    )
    return lifecycle.drivers[-1]


def test_keep_all_context_ids_decode_to_every_message(engine):
    driver = replay_driver(engine, "prefix")
    text = engine.tokenizer.decode(driver.context_ids, skip_special_tokens=False)
    for message in chat_messages():
        assert message["content"] in text
    assert text == driver.context
    assert not text.endswith(
        engine.tokenizer.decode(list(ChatFormat.from_tokenizer(engine.tokenizer).generation_prompt_ids))
    )


@pytest.mark.parametrize("mode", ["truncate", "clm"])
def test_budgeted_context_ids_are_the_context_text_and_its_token_count(make_engine, mode):
    engine = make_engine()
    driver = replay_driver(engine, mode, budget=160)
    assert engine.tokenizer.decode(driver.context_ids, skip_special_tokens=False) == driver.context
    assert len(driver.context_ids) == driver.context_tokens <= 160


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def write_inputs(tmp_path):
    transcript = tmp_path / "chat.jsonl"
    transcript.write_text("".join(json.dumps(m) + "\n" for m in chat_messages()))
    probes = tmp_path / "probes.json"
    probes.write_text(
        json.dumps(
            [
                {"question": "What is my order number?", "answer": "88412"},
                {"question": "What did we talk about?", "answer": "the weather", "alternatives": ["weather"]},
            ]
        )
    )
    return transcript, probes


def test_eval_answers_reports_every_variant_and_every_probe(tmp_path):
    transcript, probes = write_inputs(tmp_path)
    report, markdown = tmp_path / "answers.json", tmp_path / "answers.md"
    result = run(
        "eval",
        "answers",
        str(transcript),
        "--probes",
        str(probes),
        "--budget",
        "160",
        "--tagging",
        "rules,signals",  # auto would put the protocol prompt in: more than 160 byte tokens
        "--max-answer-tokens",
        "4",
        "--model",
        "tiny",
        "--report",
        str(report),
        "--markdown",
        str(markdown),
    )
    assert result.exit_code == 0, result.output
    assert "keep-all" in result.output.splitlines()[-2]  # the table's last row
    data = json.loads(report.read_text())
    assert data["probes"] == 2 and data["max_answer_tokens"] == 4
    variants = {v["variant"]: v for v in data["variants"]}
    assert list(variants) == ["clm:rules", "clm:signals", "truncate", "keep-all"]
    for variant in variants.values():
        assert [a["answer"] for a in variant["answers"]] == ["88412", "the weather"]
        assert variant["hits"] == sum(a["hit"] for a in variant["answers"])
        assert variant["retained"] == sum(a["retained"] for a in variant["answers"])
        means = [a["gold_mean_logprob"] for a in variant["answers"]]
        assert all(m < 0 for m in means) and variant["mean_gold_logprob"] == pytest.approx(sum(means) / 2)
    assert variants["keep-all"]["retained"] == 2
    assert variants["truncate"]["answers"][0]["retained"] is False  # the order number is older than the window
    assert variants["truncate"]["context_tokens"] <= 160 < variants["keep-all"]["context_tokens"]
    assert variants["truncate"]["gap_closed"] is None and variants["keep-all"]["gap_closed"] is None
    low, high = variants["truncate"]["mean_gold_logprob"], variants["keep-all"]["mean_gold_logprob"]
    for clm in (variants["clm:rules"], variants["clm:signals"]):
        if high > low:
            assert clm["gap_closed"] == pytest.approx((clm["mean_gold_logprob"] - low) / (high - low))
        else:  # the random tiny model may do worse on the longer context: no gap to close
            assert clm["gap_closed"] is None
    # the replay the answers were asked after is reported beside them, one run for both
    for name, variant in variants.items():
        replay = variant["replay"]
        assert replay["retained"] == variant["retained"] and replay["reply_nll"] > 0
        assert (replay["lifecycle_share"] is None) == (not name.startswith("clm"))
        assert replay["invented"] == 0
    text = markdown.read_text()
    assert "| variant | context tokens | retained | greedy hits |" in text and "| `88412` |" in text
    assert "| reply nll | lifecycle share | invented |" in text


def test_a_probes_file_saved_with_a_bom_is_read_as_transcripts_are(tmp_path):
    from clm_middleware.evaluation.probes import read_probes

    path = tmp_path / "p.json"
    path.write_bytes(b'\xef\xbb\xbf[{"question": "Where from?", "answer": "Anaheim"}]')
    assert [(p.question, p.answer) for p in read_probes(path)] == [("Where from?", "Anaheim")]


def test_a_probes_file_that_is_not_json_is_a_clean_error_naming_it(tmp_path):
    transcript, probes = write_inputs(tmp_path)
    probes.write_text('[{"question": "Order?", "answer": ')
    result = run("eval", "answers", str(transcript), "--probes", str(probes), "--budget", "160", "--model", "tiny")
    assert result.exit_code != 0
    assert str(probes) in result.output and "not valid JSON" in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, json.JSONDecodeError)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "is a directory, not a probes file"),
        (b"\xff\xfe\x00binary", "not UTF-8 text"),
        (b"[]", "expected a non-empty list"),
        (
            b'[{"question": "Colour?", "answer": "vermilion", "alternatives": "crimson"}]',
            'probe 0: "alternatives" must be a list',
        ),
        (  # a misspelt key: its alternatives would never have counted
            b'[{"question": "Colour?", "answer": "vermilion", "alternative": ["crimson"]}]',
            "probe 0: unknown key 'alternative'",
        ),
        (  # another tool's layout: the keys it has are named beside the ones a probe has
            b'[{"q": "Colour?", "a": "vermilion"}]',
            """probe 0: needs a non-empty string "answer" (it has 'q', 'a'; a probe has "alternatives",""",
        ),
    ],
)
def test_a_probes_file_that_cannot_be_probes_is_named_with_what_is_wrong(tmp_path, content, message):
    from clm_middleware.errors import TranscriptError
    from clm_middleware.evaluation.probes import read_probes

    path = tmp_path / "p.json"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(TranscriptError, match=rf"p\.json: {re.escape(message)}"):
        read_probes(path)
