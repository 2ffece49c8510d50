"""Self-information and attention mass from the engine, checked against direct computation.

The engine tests run with a working arena and with ``paged_kv`` alike.
"""

import pytest
import torch

from clm_middleware.engine import Observe


@pytest.fixture
def engine(make_either_engine):
    return make_either_engine()


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 5 * i) % 250 for i in range(length)]


def direct_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [None] + [float(logprobs[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]


def direct_attention(model, tokens, layers, window):
    """Mean attention of the last ``window`` queries over all positions, via eager attention."""
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            output = model(torch.tensor([tokens]), output_attentions=True)
    finally:
        model.config._attn_implementation = "sdpa"
    stacked = torch.stack([output.attentions[layer][0, :, -window:, :] for layer in layers])
    return stacked.float().mean(dim=(0, 1, 2))


def test_prompt_logprobs_equal_a_direct_computation_on_a_cold_pool(engine, tiny_model):
    tokens = prompt_of(300)  # longer than one prefill chunk
    generation = engine.generate(tokens, max_new_tokens=3, observe=Observe(logprobs=True)).result()
    expected = direct_logprobs(tiny_model, tokens)
    assert generation.prompt_logprobs[0] is None
    diffs = [abs(a - b) for a, b in zip(generation.prompt_logprobs[1:], expected[1:], strict=True)]
    assert max(diffs) <= 1e-4


def test_prompt_logprobs_after_a_pool_hit_cover_every_new_token(engine, tiny_model):
    first = prompt_of(40)
    engine.generate(first, max_new_tokens=0).result()
    tokens = first + prompt_of(20, offset=9)
    generation = engine.generate(tokens, max_new_tokens=1, observe=Observe(logprobs=True)).result()
    expected = direct_logprobs(tiny_model, tokens)
    assert generation.stats.cached_tokens == 39  # one cached token recomputed for its successor's log p
    assert generation.prompt_logprobs[:40] == [None] * 40  # the first call measured none
    for got, want in zip(generation.prompt_logprobs[40:], expected[40:], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_a_turn_extending_a_measured_reply_prefills_only_new_tokens_and_every_log_p_is_exact(engine, tiny_model):
    measured = Observe(logprobs=True)
    first = engine.generate(prompt_of(40), max_new_tokens=3, observe=measured).result()
    tokens = prompt_of(40) + first.token_ids + prompt_of(20, offset=9)
    generation = engine.generate(tokens, max_new_tokens=1, observe=measured).result()
    # the last reply token was never fed, so it is the first computed one; its log p
    # was measured while decoding and travels with the stored tail (Block.next_logprob)
    assert (generation.stats.cached_tokens, generation.stats.prefill_tokens) == (42, 21)
    expected = direct_logprobs(tiny_model, tokens)
    assert generation.prompt_logprobs[0] is None
    for got, want in zip(generation.prompt_logprobs[1:], expected[1:], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_generated_token_logprobs_match_their_logits(engine):
    generation = engine.generate(
        prompt_of(20), max_new_tokens=5, return_logits=True, observe=Observe(logprobs=True)
    ).result()
    for token, logits, logprob in zip(generation.token_ids, generation.logits, generation.token_logprobs, strict=True):
        assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)


def test_attention_mass_equals_eager_attention_weights(engine, tiny_model):
    tokens = prompt_of(70)
    layers = (0, 1)
    generation = engine.generate(
        tokens, max_new_tokens=1, observe=Observe(attention_window=8, attention_layers=layers)
    ).result()
    expected = direct_attention(tiny_model, tokens, layers, 8)
    assert generation.attention is not None
    assert generation.attention.shape == (70,)
    assert float(generation.attention.sum()) == pytest.approx(1.0, abs=1e-4)
    assert (generation.attention - expected).abs().max() <= 1e-5


def test_attention_mass_after_a_pool_hit_still_covers_the_whole_prompt(engine, tiny_model):
    first = prompt_of(64)
    engine.generate(first, max_new_tokens=0).result()
    tokens = first + prompt_of(12, offset=3)
    generation = engine.generate(
        tokens, max_new_tokens=1, observe=Observe(attention_window=8, attention_layers=(1,))
    ).result()
    assert generation.stats.cached_tokens == 64
    expected = direct_attention(tiny_model, tokens, (1,), 8)
    assert (generation.attention - expected).abs().max() <= 1e-5


def test_the_attention_window_is_computed_even_where_the_pool_holds_it(engine, tiny_model):
    tokens = prompt_of(70)
    engine.generate(tokens, max_new_tokens=0).result()  # a neighbour cached every block but the last
    generation = engine.generate(
        tokens, max_new_tokens=1, observe=Observe(attention_window=24, attention_layers=(1,))
    ).result()
    assert generation.stats.cached_tokens == 70 - 24  # the hit stops where the window starts
    expected = direct_attention(tiny_model, tokens, (1,), 24)
    assert (generation.attention - expected).abs().max() <= 1e-5


def test_chunked_prefill_keeps_reuse_exact(engine, tiny_model):
    long_prompt = prompt_of(700)
    generation = engine.generate(long_prompt, max_new_tokens=1, return_logits=True).result()
    with torch.no_grad():
        expected = tiny_model(torch.tensor([long_prompt])).logits[0, -1]
    assert (generation.logits[0] - expected).abs().max() <= 1e-4


def test_choose_picks_the_most_likely_choice_after_each_piece(engine, tiny_model):
    prefix = prompt_of(40)
    engine.generate(prefix, max_new_tokens=0).result()
    choices = [10, 20, 30]
    pieces = [[1, 2, 3], [4, 5]]
    picked = engine.choose(prefix, pieces, choices)
    with torch.no_grad():
        first = tiny_model(torch.tensor([prefix + pieces[0]])).logits[0, -1]
        index0 = int(torch.argmax(first[choices]))
        second = tiny_model(torch.tensor([prefix + pieces[0] + [choices[index0]] + pieces[1]])).logits[0, -1]
        index1 = int(torch.argmax(second[choices]))
    assert [index for index, _ in picked] == [index0, index1]
    assert all(abs(sum(probs) - 1) < 1e-5 for _, probs in picked)
    assert engine.pool.stats().blocks_in_use == 0


def test_only_the_requested_positions_are_scored_and_they_match(engine, tiny_model):
    tokens = prompt_of(300)
    wanted = frozenset({1, 2, 50, 255, 256, 257, 299})  # 256 sits on a chunk boundary
    generation = engine.generate(
        tokens, max_new_tokens=1, observe=Observe(logprobs=True, logprob_positions=wanted)
    ).result()
    expected = direct_logprobs(tiny_model, tokens)
    scored = {i for i, value in enumerate(generation.prompt_logprobs) if value is not None}
    assert scored == wanted
    for position in wanted:
        assert generation.prompt_logprobs[position] == pytest.approx(expected[position], abs=1e-4)


def test_choose_in_one_forward_scores_each_piece_after_the_supplied_text(engine, tiny_model):
    prefix = prompt_of(40)
    choices, pieces = [10, 20, 30], [[1, 2, 3], [4, 5]]
    picked = engine.choose(prefix, pieces, choices, sequential=False)
    supplied = prefix + pieces[0] + [choices[0]] + pieces[1]
    with torch.no_grad():
        logits = tiny_model(torch.tensor([supplied])).logits[0]
    first, second = logits[len(prefix) + 2], logits[-1]
    expected = [int(torch.argmax(first[choices])), int(torch.argmax(second[choices]))]
    assert [index for index, _ in picked] == expected
    assert picked[1][1] == pytest.approx(torch.softmax(second[choices], -1).tolist(), abs=1e-4)


def test_attention_probes_of_concurrent_generations_do_not_mix(make_engine):
    import threading

    engine = make_engine()
    prompts = [prompt_of(60 + 13 * i, offset=i) for i in range(4)]
    observe = Observe(attention_window=8, attention_layers=(0, 1))

    def attention_of(prompt: list[int]) -> torch.Tensor:
        return engine.generate(prompt, max_new_tokens=1, use_pool=False, observe=observe).result().attention

    expected = [attention_of(p) for p in prompts]
    results: dict[int, torch.Tensor] = {}

    def run(index: int) -> None:
        for _ in range(3):
            results[index] = attention_of(prompts[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, attention in enumerate(expected):
        assert (results[index] - attention).abs().max() <= 1e-5


def test_attention_probe_ignores_a_foreign_thread_calling_its_hook_without_kwargs(tiny_model, monkeypatch):
    """torch sets a hook's with_kwargs flag after inserting it: a forward in between calls it plainly."""
    import threading

    from clm_middleware.engine.observe import AttentionProbe

    module = tiny_model.model.layers[0].self_attn
    registered = []
    register = module.register_forward_pre_hook

    def recording_register(hook, **kwargs):
        registered.append(hook)
        return register(hook, **kwargs)

    monkeypatch.setattr(module, "register_forward_pre_hook", recording_register)
    hidden = torch.zeros(1, 3, tiny_model.config.hidden_size)
    outcome: list[object] = []
    with AttentionProbe(tiny_model, (0,)) as probe:
        foreign = threading.Thread(target=lambda: outcome.append(registered[0](module, (hidden,))))
        foreign.start()
        foreign.join()
    assert outcome == [None]
    assert probe.attention_mass(lambda layer: torch.zeros(1, 3, 8), num_tokens=3, window=2) is None
