"""Local scorers behind a remote engine (``remote/scorer.py``): the same tokenizer scores
position by position; another tokenizer is aligned to the engine's tokens by characters."""

from __future__ import annotations

import itertools

import pytest
import torch

from clm_middleware.engine import Engine
from clm_middleware.engine.observe import Observe
from clm_middleware.errors import ConfigError
from clm_middleware.models import tiny_llama, tiny_tokenizer
from clm_middleware.remote.scorer import (
    AlignedScorer,
    SameTokenizerScorer,
    _overlaps_any,
    char_spans,
    make_scorer,
    spread,
    tile,
)

PROMPT = "<|im_start|>user\nThe thin thread in the inn then ran there.<|im_end|>\n<|im_start|>assistant\n"
REPLY = "Then the inn ran thin.<|im_end|>"
MERGES = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("i", "n"), ("Ġ", "in"), ("Ġ", "th"), ("e", "r"), ("a", "n")]


def merging_tokenizer():
    """Byte-level like the tiny tokenizer, plus a few merges: a different tokenization of the same text."""
    return tiny_tokenizer(merges=MERGES)


@pytest.fixture(scope="module")
def merging_engine():
    tokenizer = merging_tokenizer()
    return Engine(tiny_llama(seed=3, vocab_size=len(tokenizer)), tokenizer)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_char_spans_tile_the_decoded_text_in_order_even_where_a_character_is_split_over_bytes():
    tok = tiny_tokenizer()
    tokens = ids(tok, "<|im_start|>café ✓<|im_end|>")
    text, spans = char_spans(tok, tokens)
    assert text == "<|im_start|>café ✓<|im_end|>" and len(spans) == len(tokens)
    assert spans[0] == (0, len("<|im_start|>"))
    assert all(a <= b for a, b in spans) and all(p[1] <= n[0] for p, n in itertools.pairwise(spans))
    assert "".join(text[a:b] for a, b in spans) == text  # every character once


def test_tile_gives_a_character_split_over_tokens_to_its_first_token():
    assert tile([(0, 3), (3, 4), (3, 4), (4, 6)]) == [(0, 3), (3, 4), (4, 4), (4, 6)]


def test_spread_shares_a_value_by_character_overlap_and_conserves_the_sum():
    sources = [(0, 3), (3, 9), (9, 13)]  # "The", " quick", " fox"
    targets = [(0, 3), (3, 6), (6, 9), (9, 13)]
    assert spread([1.0, 6.0, 2.0], sources, targets) == [1.0, 3.0, 3.0, 2.0]
    assert spread([None, 6.0, 2.0], sources, targets) == [None, 3.0, 3.0, 2.0]
    merged = spread([1.0, 3.0, 3.0, 2.0], targets, sources)
    assert merged == [1.0, 6.0, 2.0]


def test_make_scorer_scores_token_by_token_only_with_the_served_models_tokenizer(engine, merging_engine):
    assert isinstance(make_scorer(tiny_tokenizer(), engine), SameTokenizerScorer)
    assert isinstance(make_scorer(tiny_tokenizer(), merging_engine), AlignedScorer)


def test_an_aligned_scorer_with_the_same_tokenizer_reads_exactly_what_the_scorer_reads(make_engine):
    """The alignment is the identity when the tokenizations agree: every figure equals the direct one."""
    tok = tiny_tokenizer()
    prompt, reply = ids(tok, PROMPT), ids(tok, REPLY)
    observe = Observe(logprobs=True, attention_window=8)
    direct = SameTokenizerScorer(make_engine()).observe(prompt, observe, reply)
    aligned = AlignedScorer(make_engine(), tok).observe(prompt, observe, reply)
    assert aligned.prompt_logprobs[0] is None and direct.prompt_logprobs[0] is None
    assert aligned.prompt_logprobs[1:] == pytest.approx(direct.prompt_logprobs[1:], abs=1e-5)
    assert torch.allclose(aligned.attention, direct.attention.float(), atol=1e-5)
    assert aligned.token_logprobs == pytest.approx(direct.token_logprobs, abs=1e-5)
    prefix, answers = prompt, [ids(tok, "Then"), ids(tok, "The inn.")]
    assert AlignedScorer(make_engine(), tok).score(prefix, answers) == pytest.approx(
        SameTokenizerScorer(make_engine()).score(prefix, answers), abs=1e-4
    )


def test_an_aligned_scorer_with_its_own_tokenizer_conserves_surprisal_attention_and_a_replys_log_p(
    merging_engine,
):
    served = tiny_tokenizer()
    prompt, reply = ids(served, PROMPT), ids(served, REPLY)
    scorer_tok = merging_engine.tokenizer
    own_prompt, own_reply = ids(scorer_tok, PROMPT), ids(scorer_tok, REPLY)
    assert len(own_prompt) < len(prompt)  # the merges make it a different tokenization
    observe = Observe(logprobs=True, attention_window=len(prompt))
    aligned = AlignedScorer(merging_engine, served).observe(prompt, observe, reply)
    own = merging_engine.generate(
        own_prompt,
        max_new_tokens=0,
        observe=Observe(logprobs=True, attention_window=len(own_prompt)),
        forced_token_ids=own_reply,
    ).result()
    assert len(aligned.prompt_logprobs) == len(prompt) and len(aligned.token_logprobs) == len(reply)
    mapped = sum(v for v in aligned.prompt_logprobs if v is not None)
    assert mapped == pytest.approx(sum(v for v in own.prompt_logprobs if v is not None), abs=1e-3)
    assert float(aligned.attention.sum()) == pytest.approx(float(own.attention.sum()), abs=1e-4)
    assert sum(aligned.token_logprobs) == pytest.approx(sum(own.token_logprobs), abs=1e-3)
    [total] = AlignedScorer(merging_engine, served).score(prompt, [reply])
    assert total == pytest.approx(sum(own.token_logprobs), abs=1e-3)


def test_an_aligned_scorer_reads_only_the_positions_asked_for(merging_engine):
    served = tiny_tokenizer()
    prompt = ids(served, PROMPT)
    wanted = frozenset(range(20, 30))
    scores = AlignedScorer(merging_engine, served).observe(prompt, Observe(logprobs=True, logprob_positions=wanted), [])
    assert {p for p, v in enumerate(scores.prompt_logprobs) if v is not None} == wanted
    assert scores.attention is None and scores.token_logprobs is None


def test_an_aligned_scorer_refuses_constrained_choices_across_vocabularies(merging_engine):
    with pytest.raises(ConfigError, match="another tokenizer"):
        AlignedScorer(merging_engine, tiny_tokenizer()).choose([1, 2], [[3]], [4, 5])


def test_overlap_lookup_finds_the_span_reaching_furthest():
    spans = [(0, 3), (5, 9)]
    starts = [0, 5]
    assert _overlaps_any((2, 6), spans, starts) and _overlaps_any((8, 12), spans, starts)
    assert not _overlaps_any((3, 5), spans, starts) and not _overlaps_any((9, 10), spans, starts)
