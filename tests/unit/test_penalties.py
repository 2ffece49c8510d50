from itertools import pairwise

import pytest
import torch

from clm_middleware.adapters import ChatCLM
from clm_middleware.conversation import Conversation
from clm_middleware.engine import GenerationDefaults, penalty_processors
from clm_middleware.engine.penalties import CountPenalty, NoRepeatNgram, RepetitionPenalty
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle import GenerationSettings
from clm_middleware.replay.runner import ReplayOptions

INF = float("-inf")


def spy_on_processors(engine, monkeypatch) -> list[tuple]:
    """Record the logits_processors of every engine.generate call."""
    seen: list[tuple] = []
    generate = engine.generate

    def spy(*args, **kwargs):
        seen.append(tuple(kwargs.get("logits_processors", ())))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    return seen


def repeated_bigrams(ids: list[int]) -> set[tuple[int, int]]:
    bigrams = list(pairwise(ids))
    return {b for b in bigrams if bigrams.count(b) > 1}


# ------------------------------------------------------------ the processors


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_generated_tokens():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    shaped = RepetitionPenalty(2.0)([0, 1, 1], logits)
    assert shaped.tolist() == [1.0, -2.0, 0.5, 3.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # the raw logits are not written into


def test_frequency_and_presence_penalties_subtract_count_times_frequency_plus_presence():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    shaped = CountPenalty(frequency=0.5, presence=0.25)([0, 0, 2, 0], logits)
    assert shaped.tolist() == [1.0 - 3 * 0.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0]


def test_no_repeat_ngram_bans_the_tokens_that_would_complete_a_seen_ngram():
    logits = torch.zeros(8)
    assert NoRepeatNgram(2)([5, 6, 5], logits).tolist() == [0, 0, 0, 0, 0, 0, INF, 0]
    assert NoRepeatNgram(3)([1, 2, 3, 1, 2], logits).tolist() == [0, 0, 0, INF, 0, 0, 0, 0]
    assert NoRepeatNgram(1)([4, 1], logits).tolist() == [0, INF, 0, 0, INF, 0, 0, 0]
    assert torch.equal(NoRepeatNgram(3)([1, 2], logits), logits)  # no complete 3-gram yet


def test_minus_infinity_stays_minus_infinity_and_a_forced_token_wins_over_the_ban():
    forced = torch.tensor([INF, 0.0, INF, INF])  # as ScriptedReplies forces token 1
    settings = GenerationSettings(
        repetition_penalty=1.5, frequency_penalty=-2.0, presence_penalty=-2.0, no_repeat_ngram_size=2
    )
    shaped = forced
    for processor in penalty_processors(settings):
        shaped = processor([0, 1, 2, 3, 0, 1], shaped)  # bigram (1, 2) seen: token 2 banned, 1 free
    assert shaped[[0, 2, 3]].tolist() == [INF, INF, INF]
    assert int(torch.argmax(shaped)) == 1
    only_banned = torch.tensor([INF, INF, 0.0, INF])
    assert torch.equal(NoRepeatNgram(2)([1, 2, 1], only_banned), only_banned)


def test_every_control_off_builds_no_processors():
    assert penalty_processors(GenerationSettings()) == ()
    settings = GenerationSettings(repetition_penalty=1.2, presence_penalty=0.5, no_repeat_ngram_size=3)
    assert penalty_processors(settings) == (RepetitionPenalty(1.2), CountPenalty(0.0, 0.5), NoRepeatNgram(3))


def test_no_repeat_ngram_size_2_leaves_no_repeated_bigram_in_40_greedy_tokens(engine, tiny_tok):
    prompt = tiny_tok.encode("hello hello hello", add_special_tokens=False)
    plain = engine.generate(prompt, max_new_tokens=40, stop_token_ids=()).result()
    assert repeated_bigrams(plain.token_ids)  # the random model loops without the ban
    processors = penalty_processors(GenerationSettings(no_repeat_ngram_size=2))
    banned = engine.generate(prompt, max_new_tokens=40, stop_token_ids=(), logits_processors=processors).result()
    assert len(banned.token_ids) == 40
    assert repeated_bigrams(banned.token_ids) == set()


# ------------------------------------------------------------- settings


def test_unset_controls_resolve_from_the_models_generation_config(engine, tiny_model, monkeypatch):
    assert engine.generation_defaults == GenerationDefaults(repetition_penalty=1.0, no_repeat_ngram_size=0)
    monkeypatch.setattr(tiny_model.generation_config, "repetition_penalty", 1.3)
    monkeypatch.setattr(tiny_model.generation_config, "no_repeat_ngram_size", 4)
    defaults = engine.generation_defaults
    assert penalty_processors(GenerationSettings(), defaults) == (RepetitionPenalty(1.3), NoRepeatNgram(4))
    explicit_off = GenerationSettings(repetition_penalty=1.0, no_repeat_ngram_size=0)
    assert penalty_processors(explicit_off, defaults) == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("no_repeat_ngram_size", -1),
    ],
)
def test_out_of_range_controls_are_config_errors_naming_the_field(field, value):
    for settings in (GenerationSettings, ReplayOptions):
        with pytest.raises(ConfigError) as error:
            settings(**{field: value})
        assert error.value.field == field


def test_a_conversation_passes_its_controls_to_every_turn_and_to_a_reload(converse, engine, monkeypatch):
    seen = spy_on_processors(engine, monkeypatch)
    chat = converse(repetition_penalty=1.2, frequency_penalty=0.5, no_repeat_ngram_size=3)
    chat.send("hello there")
    assert seen[0] == (RepetitionPenalty(1.2), CountPenalty(0.5, 0.0), NoRepeatNgram(3))
    reloaded = Conversation(engine, **chat.settings())  # what Conversation.load does with stored settings
    assert reloaded.generation.repetition_penalty == 1.2
    assert reloaded.generation.frequency_penalty == 0.5
    assert reloaded.generation.no_repeat_ngram_size == 3


def test_chatclm_fields_and_per_call_kwargs_reach_the_processors(engine, monkeypatch):
    seen = spy_on_processors(engine, monkeypatch)
    llm = ChatCLM(engine=engine, tagging="signals", max_tokens=4, presence_penalty=0.5)
    llm.invoke("hello")
    assert seen[-1] == (CountPenalty(0.0, 0.5),)
    llm.invoke("hello again", frequency_penalty=1.0, no_repeat_ngram_size=2)
    assert seen[-1] == (CountPenalty(1.0, 0.5), NoRepeatNgram(2))


def test_logit_bias_bans_or_forces_a_token_and_names_bad_entries(engine):
    conversation = Conversation(engine, tagging="rules", max_new_tokens=6)
    conversation.add("user", "Say something.")
    plain = conversation.respond().text
    first = engine.tokenizer.encode(plain, add_special_tokens=False)[0] if plain else None
    forced = engine.tokenizer.encode("z", add_special_tokens=False)[0]
    conversation.add("user", "Again.")
    biased = conversation.respond(settings=GenerationSettings(max_new_tokens=6, logit_bias={str(forced): 100}))
    assert biased.text and set(biased.text) == {"z"}  # +100 all but forces it
    if first is not None and first != forced:
        conversation.add("user", "Say something.")
        banned = conversation.respond(settings=GenerationSettings(max_new_tokens=6, logit_bias={first: -100}))
        assert not banned.text.startswith(engine.tokenizer.decode([first]))
    for bad, named in (({"x": 1}, "token ids"), ({5: 200}, r"\[-100, 100\]"), ({5: "up"}, "numbers")):
        with pytest.raises(ConfigError, match=f"logit_bias: .*{named}"):
            GenerationSettings(logit_bias=bad)
    conversation.add("user", "Once more.")
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        conversation.respond(settings=GenerationSettings(logit_bias={engine.vocab_size: 1}))
