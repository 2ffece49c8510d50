"""top_k and min_p: transformers' semantics, defaults from the model, wired to every entry point."""

import math

import pytest
import torch

from clm_middleware.adapters import ChatCLM
from clm_middleware.conversation import Conversation
from clm_middleware.engine import GenerationDefaults, SamplingParams
from clm_middleware.engine.sampling import choose_token, sorted_distribution
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle import GenerationSettings
from clm_middleware.replay.runner import ReplayOptions
from clm_middleware.server.convert import chat_request
from clm_middleware.server.schemas import ChatCompletionRequest

# a distribution with known probabilities: 0.5, 0.3, 0.15, 0.05
PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])
LOGITS = PROBS.log()


def sampled(logits: torch.Tensor, params: SamplingParams, draws: int = 300) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {choose_token(logits, params, generator) for _ in range(draws)}


def spy_on_sampling(engine, monkeypatch) -> list[SamplingParams]:
    """Record the resolved ``SamplingParams`` of every engine.generate call."""
    seen: list[SamplingParams] = []
    generate = engine.generate

    def spy(*args, **kwargs):
        generation = generate(*args, **kwargs)
        seen.append(generation.request.sampling)
        return generation

    monkeypatch.setattr(engine, "generate", spy)
    return seen


# ------------------------------------------------------------- the sampler


def test_top_k_1_always_picks_the_argmax_like_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    assert sampled(logits, SamplingParams(temperature=1.5, top_k=1)) == {int(torch.argmax(logits))}


def test_top_k_1_generation_equals_greedy_generation(engine):
    prompt = engine.tokenizer.encode("the cat sat on", add_special_tokens=False)
    greedy = engine.generate(prompt, max_new_tokens=12).result().token_ids
    top1 = engine.generate(prompt, max_new_tokens=12, temperature=1.0, top_k=1, seed=7).result().token_ids
    assert top1 == greedy


def test_top_k_keeps_the_k_likeliest_tokens_and_ties_with_the_kth():
    probs, order = sorted_distribution(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert order[:2].tolist() == [1, 3]
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    tied = torch.tensor([1.0, 2.0, 2.0, 0.0])
    probs, _ = sorted_distribution(tied, SamplingParams(temperature=1.0, top_k=1))
    assert int((probs > 0).sum()) == 2  # as TopKLogitsWarper: a tie with the k-th stays


def test_min_p_removes_tokens_below_min_p_times_the_top_probability():
    # threshold 0.2 × 0.5 = 0.1: only the 0.05 token goes
    probs, order = sorted_distribution(LOGITS, SamplingParams(temperature=1.0, min_p=0.2))
    assert order.tolist() == [1, 3, 2, 0]
    assert probs.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    assert sampled(LOGITS, SamplingParams(temperature=1.0, min_p=0.2)) == {1, 3, 2}
    # threshold 0.7 × 0.5 = 0.35: only the top token stays
    assert sampled(LOGITS, SamplingParams(temperature=1.0, min_p=0.7)) == {1}


def test_min_p_compares_probabilities_after_the_temperature():
    # at temperature 2 the probabilities flatten (∝ sqrt p): 0.05 becomes ≈ 0.11 of the top, so it stays
    flat = SamplingParams(temperature=2.0, min_p=0.2)
    assert sampled(LOGITS, flat) == {0, 1, 2, 3}
    assert math.sqrt(0.05 / 0.5) > 0.2


def test_filters_run_in_transformers_order_top_k_then_top_p_then_min_p():
    # top_k 3 renormalises 0.5/0.3/0.15 over 0.95; top_p 0.8 then needs 0.526 + 0.316 ≥ 0.8: two tokens
    probs, order = sorted_distribution(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert order[:2].tolist() == [1, 3]
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])


def test_greedy_decoding_ignores_the_filters(engine):
    prompt = engine.tokenizer.encode("one two three", add_special_tokens=False)
    plain = engine.generate(prompt, max_new_tokens=10).result().token_ids
    filtered = engine.generate(prompt, max_new_tokens=10, top_k=3, min_p=0.9).result().token_ids
    assert filtered == plain


# ------------------------------------------------------------- validation


@pytest.mark.parametrize(("field", "value"), [("top_k", -1), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5)])
def test_invalid_top_k_or_min_p_is_a_config_error_naming_the_field(field, value, engine):
    for settings in (SamplingParams, GenerationSettings, ReplayOptions):
        with pytest.raises(ConfigError) as error:
            settings(**{field: value})
        assert error.value.field == field
    with pytest.raises(ConfigError) as error:
        engine.generate([1, 2, 3], **{field: value})
    assert error.value.field == field


def test_chatclm_rejects_an_invalid_min_p_at_construction():
    with pytest.raises(ValueError, match="min_p"):
        ChatCLM(model="tiny", min_p=2.0)


# ------------------------------------------------------------- defaults and wiring


def test_unset_filters_come_from_the_models_generation_config_or_are_off(engine, tiny_model, monkeypatch):
    assert engine.generation_defaults == GenerationDefaults()
    assert engine.generate([1, 2, 3], temperature=1.0).request.sampling.top_k == 0
    monkeypatch.setattr(tiny_model.generation_config, "top_k", 5, raising=False)
    monkeypatch.setattr(tiny_model.generation_config, "min_p", 0.1, raising=False)
    sampling = engine.generate([1, 2, 3], temperature=1.0).request.sampling
    assert (sampling.top_k, sampling.min_p) == (5, 0.1)
    off = engine.generate([1, 2, 3], temperature=1.0, top_k=0, min_p=0.0).request.sampling
    assert (off.top_k, off.min_p) == (0, 0.0)


def test_a_conversation_samples_with_its_filters_and_keeps_them_on_reload(converse, engine, monkeypatch):
    seen = spy_on_sampling(engine, monkeypatch)
    chat = converse(temperature=0.8, top_k=4, min_p=0.05, seed=1)
    chat.send("hello there")
    assert (seen[-1].top_k, seen[-1].min_p, seen[-1].temperature) == (4, 0.05, 0.8)
    reloaded = Conversation(engine, **chat.settings())  # what Conversation.load does with stored settings
    assert (reloaded.generation.top_k, reloaded.generation.min_p) == (4, 0.05)


def test_chatclm_fields_and_per_call_kwargs_reach_the_sampler(engine, monkeypatch):
    seen = spy_on_sampling(engine, monkeypatch)
    llm = ChatCLM(engine=engine, tagging="signals", max_tokens=4, temperature=0.7, top_k=8)
    llm.invoke("hello")
    assert (seen[-1].top_k, seen[-1].min_p) == (8, 0.0)
    llm.invoke("hello again", top_k=2, min_p=0.3)
    assert (seen[-1].top_k, seen[-1].min_p) == (2, 0.3)


def test_chatclm_accepts_repeat_penalty_as_ollamas_name_for_repetition_penalty(engine):
    assert ChatCLM(engine=engine, repeat_penalty=1.1).repetition_penalty == 1.1
    llm = ChatCLM(engine=engine)
    assert llm._settings(None, {"repeat_penalty": 1.2}).repetition_penalty == 1.2
    with pytest.raises(ValueError, match="repeat_penalty: is another name for 'repetition_penalty'"):
        ChatCLM(engine=engine, repeat_penalty=1.1, repetition_penalty=1.3)


def test_the_server_takes_top_k_and_min_p_as_vllm_and_llama_cpp_do():
    defaults = GenerationSettings(top_k=40)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert chat_request(ChatCompletionRequest(**body), defaults, None).settings.top_k == 40
    settings = chat_request(ChatCompletionRequest(**body, top_k=5, min_p=0.1), defaults, None).settings
    assert (settings.top_k, settings.min_p) == (5, 0.1)
    assert chat_request(ChatCompletionRequest(**body, top_k=-1), defaults, None).settings.top_k == 0  # vLLM's "off"


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70, 1.5])
def test_a_seed_torch_cannot_take_is_a_config_error_naming_seed(seed):
    from clm_middleware.engine.sampling import SamplingParams
    from clm_middleware.lifecycle.config import GenerationSettings

    with pytest.raises(ConfigError, match="seed"):
        GenerationSettings(seed=seed)
    with pytest.raises(ConfigError, match="seed"):
        SamplingParams(temperature=1.0, seed=seed)


def test_the_ends_of_the_seed_range_seed_a_generator():
    from clm_middleware.engine.sampling import SEED_RANGE, SamplingParams

    for seed in SEED_RANGE:
        assert SamplingParams(temperature=1.0, seed=seed).generator(torch.device("cpu")) is not None


def test_seeds_that_share_their_low_32_bits_sample_differently():
    """torch's CPU generator keeps only a seed's low 32 bits: -1, 2**63 - 1 and 2**64 - 1
    sampled alike through clm serve (a sweep). Seeds under 2**32 seed it as they are."""
    from clm_middleware.engine.sampling import generator_seed

    def draws(seed: int) -> list[float]:
        generator = SamplingParams(temperature=1.0, seed=seed).generator(torch.device("cpu"))
        return torch.rand(4, generator=generator).tolist()

    assert len({tuple(draws(seed)) for seed in (-1, 2**63 - 1, 2**64 - 1, 2**32 - 1)}) == 4
    assert generator_seed(7) == 7 and draws(7) == draws(7)
