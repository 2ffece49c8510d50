"""SmolLM2-135M with quantization="int4": the Q4_1 file's own codes, the replies' likelihood of fp32."""

import dataclasses
from pathlib import Path

import pytest

from clm_middleware.engine import Engine
from clm_middleware.lifecycle.reply_quality import has_artifact
from clm_middleware.models.loading import load_model, load_tokenizer
from clm_middleware.models.quantization import Int4Linear, quantize_model
from clm_middleware.render import ChatFormat
from clm_middleware.replay.report import ReplayReport
from clm_middleware.replay.runner import PlainChatDriver, ReplayOptions, replay
from clm_middleware.replay.transcript import read_jsonl

DATA = Path(__file__).parent.parent / "data"
REPLIES = 10


@pytest.fixture(scope="module")
def int4_engine() -> Engine:
    model = load_model()
    quantize_model(model, "int4")
    return Engine(model, load_tokenizer())


def reply_nll(engine: Engine) -> float:
    """Over the bundled chat's first ten replies: the whole chat measured the same gap
    (3.1083 fp32, 3.1072 int4) in four times the suite's time."""
    [whole] = read_jsonl(DATA / "lisbon_trip.jsonl")
    transcript = dataclasses.replace(whole, messages=whole.messages[: REPLIES * 2])
    options = ReplayOptions(mode="prefix", teacher_force=True)
    chat = ChatFormat.from_tokenizer(engine.tokenizer)
    report = ReplayReport(mode="prefix", model="smollm2")
    replay(
        [transcript], lambda t: PlainChatDriver(engine, chat, options, t.conversation_id), report, teacher_force=True
    )
    return report.totals()["reply_nll"]


def test_the_4_bit_codes_are_the_gguf_files_own(int4_engine):
    layers = [m for m in int4_engine.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 7 * int4_engine.model.config.num_hidden_layers
    assert max(layer.max_weight_error for layer in layers) == 0.0


def test_int4_keeps_the_replies_likelihood_and_answers_in_sentences(smol_engine, int4_engine):
    # measured 3.1831 (fp32) and 3.1841 (int4), teacher-forced
    assert abs(reply_nll(int4_engine) - reply_nll(smol_engine)) < 0.02
    chat = ChatFormat.from_tokenizer(int4_engine.tokenizer)
    prompt = chat.render([("user", chat.encode("Name three colours."))])
    reply = int4_engine.generate(prompt, max_new_tokens=24).result().text
    assert len(reply.split()) >= 3 and not has_artifact(reply)


def test_int4_with_a_compiled_decode_step_answers_as_the_uncompiled_one(int4_engine, tmp_path):
    """compile_decode on SmolLM2 with 4-bit weights (~45 s to compile): the same weights,
    one fused step; logits within bf16 rounding of the forward's, a reply in words."""
    compiled = Engine(int4_engine.model, int4_engine.tokenizer, compile_decode=True, compile_cache_dir=tmp_path)
    assert compiled.decoder.report.source == "compiled"
    chat = ChatFormat.from_tokenizer(int4_engine.tokenizer)
    prompt = chat.render([("user", chat.encode("Name three colours."))])
    expected = int4_engine.generate(prompt, max_new_tokens=2, return_logits=True, use_pool=False).result()
    got = compiled.generate(prompt, max_new_tokens=24, return_logits=True, use_pool=False).result()
    assert got.token_ids[0] == expected.token_ids[0]  # from the prefill, which is not compiled
    scale = float(expected.logits[1].abs().max())
    assert float((got.logits[1] - expected.logits[1]).abs().max()) <= 0.05 * scale
    assert len(got.text.split()) >= 3 and not has_artifact(got.text)
