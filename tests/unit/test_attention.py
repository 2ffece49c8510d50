"""Grouped-query attention without repeat_kv copies: used where it applies, exact."""

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from clm_middleware.engine import Engine
from clm_middleware.engine.attention import GQA_SDPA, use_gqa_attention
from clm_middleware.models import tiny_llama

EXACT = 1e-4


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 11 * i) % 250 for i in range(length)]


@pytest.fixture
def model():
    return tiny_llama()  # its own copy: these tests switch attention implementations


def test_an_engine_points_a_gqa_model_at_the_copy_free_path(model, tiny_tok):
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    engine = Engine(model, tiny_tok)
    assert engine.gqa_attention and model.config._attn_implementation == GQA_SDPA


def test_an_explicit_non_sdpa_choice_is_left_alone(model, tiny_tok):
    model.set_attn_implementation("eager")
    assert not use_gqa_attention(model)
    assert not Engine(model, tiny_tok).gqa_attention and model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    assert not Engine(model, tiny_tok, gqa_attention=False).gqa_attention


def test_masked_prefill_chunks_repeat_no_kv_heads_and_logits_equal_a_full_recompute(model, tiny_tok, monkeypatch):
    engine = Engine(model, tiny_tok)
    engine.generate(prompt_of(40), max_new_tokens=0).result()
    prompt = prompt_of(40) + prompt_of(300, offset=3)  # chunks after a cached prefix carry a mask
    copies = []
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda states, groups: copies.append(groups) or states)
    generation = engine.generate(prompt, max_new_tokens=3, return_logits=True).result()
    assert copies == [] and generation.stats.cached_tokens == 40
    monkeypatch.undo()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, -1]
    assert (generation.logits[0] - reference).abs().max() <= EXACT


def test_without_it_transformers_copies_the_kv_heads_of_every_masked_chunk(model, tiny_tok, monkeypatch):
    model.set_attn_implementation("sdpa")
    engine = Engine(model, tiny_tok, gqa_attention=False)
    engine.generate(prompt_of(40), max_new_tokens=0).result()
    copies = []
    original = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda states, groups: copies.append(groups) or original(states, groups))
    engine.generate(prompt_of(40) + prompt_of(30, offset=3), max_new_tokens=1).result()
    assert len(copies) == 2 * model.config.num_hidden_layers  # K and V, every layer, for the one masked chunk
