"""The protocol calibration: measured once per model and prompt, cached on disk, decides auto's start."""

from __future__ import annotations

import json
import stat
import warnings

import pytest

from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.lifecycle.calibration import CALIBRATION_CHATS, protocol_verdict

PROMPT = "Label segments in a [LIFECYCLE] block."
BLOCK = "Sure.\n[LIFECYCLE]\nseg_1: keep\n[/LIFECYCLE]"


def test_a_scripted_model_that_writes_blocks_passes_every_probe(scripted, tmp_path):
    engine, script = scripted(*[BLOCK] * len(CALIBRATION_CHATS))
    verdict = protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=tmp_path)
    assert verdict.follows and verdict.passed == verdict.probes == len(CALIBRATION_CHATS)
    assert verdict.source == "measured" and script.remaining == 0
    assert list(tmp_path.iterdir()) == []  # an engine with its own logits processors is not cached on disk


def test_a_model_that_writes_no_block_fails_after_one_probe(scripted, tmp_path):
    engine, script = scripted(*["No block at all."] * len(CALIBRATION_CHATS))
    verdict = protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=tmp_path)
    assert not verdict.follows and (verdict.passed, verdict.probes) == (0, 1)
    assert script.started == 1


def test_a_flaky_model_fails_at_the_first_miss_that_makes_the_threshold_unreachable(scripted, tmp_path):
    engine, _ = scripted(BLOCK, "forgot the block", BLOCK)
    verdict = protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=tmp_path)
    assert not verdict.follows and (verdict.passed, verdict.probes) == (1, 2)
    patient, _ = scripted(BLOCK, "forgot the block", BLOCK)
    lenient = protocol_verdict(patient, PROMPT, threshold=0.6, cache_dir=tmp_path)
    assert lenient.follows and (lenient.passed, lenient.probes) == (2, 3)


def test_the_verdict_is_remembered_per_engine_and_prompt(scripted, tmp_path):
    engine, script = scripted(*[BLOCK] * len(CALIBRATION_CHATS))
    protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=tmp_path)
    again = protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=tmp_path)
    assert again.follows and again.source == "memory" and script.started == len(CALIBRATION_CHATS)
    other_prompt = protocol_verdict(engine, PROMPT + " Be brief.", threshold=0.9, cache_dir=tmp_path)
    assert other_prompt.source == "measured" and not other_prompt.follows  # the script ran out


def test_the_disk_cache_is_owner_only_and_spares_a_new_engine_the_probes(tiny_model, tiny_tok, tmp_path):
    first = Engine(tiny_model, tiny_tok)
    measured = protocol_verdict(first, PROMPT, threshold=0.9, cache_dir=tmp_path / "cal")
    [path] = (tmp_path / "cal").iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "cal").stat().st_mode) == 0o700
    second = Engine(tiny_model, tiny_tok)
    cached = protocol_verdict(second, PROMPT, threshold=0.9, cache_dir=tmp_path / "cal")
    assert cached.source == "disk" and cached.follows == measured.follows
    assert second.stats.calls == 0  # nothing was generated


def test_a_corrupt_or_foreign_cache_file_is_measured_again(tiny_model, tiny_tok, tmp_path):
    engine = Engine(tiny_model, tiny_tok)
    protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=tmp_path)
    [path] = tmp_path.iterdir()
    foreign = {**json.loads(path.read_text()), "model_fingerprint": "another model"}
    for content in ("{not json", json.dumps({"follows": True}), json.dumps(foreign)):
        path.write_text(content)
        fresh = Engine(tiny_model, tiny_tok)
        verdict = protocol_verdict(fresh, PROMPT, threshold=0.9, cache_dir=tmp_path)
        assert verdict.source == "measured" and fresh.stats.calls >= 1
        assert json.loads(path.read_text())["model_fingerprint"] == engine.fingerprint  # rewritten whole


def test_an_unwritable_cache_dir_keeps_the_verdict_in_memory(tiny_model, tiny_tok, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    engine = Engine(tiny_model, tiny_tok)
    verdict = protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=blocker / "cal")
    assert verdict.source == "measured"
    assert protocol_verdict(engine, PROMPT, threshold=0.9, cache_dir=blocker / "cal").source == "memory"


def test_an_explicit_protocol_mode_warns_once_when_a_calibration_found_the_model_fails(scripted):
    """``free`` and ``constrained`` show the protocol whatever the verdict (the user chose
    them); a verdict already measured is read, never measured for them, and said once."""
    engine, script = scripted(*["No block at all."] * len(CALIBRATION_CHATS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no verdict yet: nothing to say, and nothing is measured
        Conversation(engine, tagging="constrained", protocol_prompt=PROMPT)
    assert script.started == 0
    assert not protocol_verdict(engine, PROMPT, threshold=0.9).follows
    with pytest.warns(RuntimeWarning, match=r"tagging='constrained': this model failed the protocol calibration \(0/1"):
        Conversation(engine, tagging="constrained", protocol_prompt=PROMPT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Conversation(engine, tagging="constrained", protocol_prompt=PROMPT)  # once per engine and mode
        Conversation(engine, tagging="signals", protocol_prompt=PROMPT)  # shows no protocol
    with pytest.warns(RuntimeWarning, match="tagging='free'"):
        Conversation(engine, tagging="free", protocol_prompt=PROMPT)


def test_an_explicit_protocol_mode_on_a_model_that_follows_says_nothing(scripted):
    engine, _ = scripted(*[BLOCK] * len(CALIBRATION_CHATS))
    assert protocol_verdict(engine, PROMPT, threshold=0.9).follows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Conversation(engine, tagging="free", protocol_prompt=PROMPT)
