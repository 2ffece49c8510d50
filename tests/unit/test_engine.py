"""Engine on the tiny model: reuse is exact, stats add up, edges fail clearly.

Every test runs twice: with a working arena (the default) and with ``paged_kv`` (the
model attends over the pool's blocks in place); both keep the same contracts.
"""

import threading

import pytest
import torch

from clm_middleware.errors import ConfigError, ContextWindowError, PoolExhaustedError, PoolTooSmallError

EXACT = 1e-4  # the contract: fp32, max abs diff between reused and recomputed logits


@pytest.fixture
def make_engine(make_either_engine):
    return make_either_engine


@pytest.fixture
def engine(make_either_engine):
    return make_either_engine()


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 250 for i in range(length)]


def recomputed_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1]


def first_logits(engine, token_ids: list[int], **kwargs) -> tuple[torch.Tensor, object]:
    generation = engine.generate(token_ids, max_new_tokens=1, return_logits=True, **kwargs).result()
    return generation.logits[0], generation


@pytest.mark.parametrize(
    ("cached_prefix", "tail"),
    [(32, 5), (32, 16), (48, 1), (40, 24)],
    ids=[
        "tail-shorter-than-a-block",
        "tail-exactly-one-block",
        "one-token-tail",
        "unaligned-prefix",
    ],
)
def test_logits_with_reused_blocks_equal_a_full_recompute(engine, tiny_model, cached_prefix, tail):
    first = prompt_of(cached_prefix)
    engine.generate(first, max_new_tokens=0).result()
    prompt = first + prompt_of(tail, offset=3)
    logits, generation = first_logits(engine, prompt)
    assert generation.stats.cached_tokens == cached_prefix  # token-exact: a partial last block is reused too
    assert (logits - recomputed_logits(tiny_model, prompt)).abs().max() <= EXACT


def test_a_repeated_prompt_recomputes_only_its_last_token(engine, tiny_model):
    prompt = prompt_of(64)
    engine.generate(prompt, max_new_tokens=0).result()
    logits, generation = first_logits(engine, prompt)
    assert (generation.stats.cached_tokens, generation.stats.prefill_tokens) == (63, 1)
    assert (logits - recomputed_logits(tiny_model, prompt)).abs().max() <= EXACT


def test_each_turn_that_extends_the_previous_one_prefills_exactly_its_new_tokens(engine, tiny_model):
    history = prompt_of(21)
    previous = engine.generate(history, max_new_tokens=7).result()
    for turn in range(1, 5):
        added = previous.token_ids + prompt_of(3 + 5 * turn, offset=turn)
        history = history + added
        logits, generation = first_logits(engine, history)
        # the reply's last token was chosen but never fed: it is computed with the new ones
        assert generation.stats.prefill_tokens == len(added) - len(previous.token_ids) + 1
        assert (logits - recomputed_logits(tiny_model, history)).abs().max() <= EXACT
        previous = generation
    engine.pool.check_invariants()


def test_a_prompt_that_diverges_inside_a_cached_block_reuses_the_tokens_before_the_change(engine, tiny_model):
    first = prompt_of(60)
    engine.generate(first, max_new_tokens=0).result()
    prompt = first[:37] + prompt_of(12, offset=4)  # block 2 (positions 32-47) holds 5 matching tokens
    logits, generation = first_logits(engine, prompt)
    assert generation.stats.cached_tokens == 37
    assert (logits - recomputed_logits(tiny_model, prompt)).abs().max() <= EXACT
    engine.pool.check_invariants()


def test_reuse_stays_exact_after_evictions(make_engine, tiny_model):
    engine = make_engine(max_blocks=12)
    shared = prompt_of(64)
    engine.generate(shared, max_new_tokens=0).result()
    for offset in range(1, 4):  # other prompts push the shared chain's tail out
        engine.generate(prompt_of(64, offset=offset * 31), max_new_tokens=0).result()
    assert engine.pool.stats().evictions > 0
    prompt = shared + prompt_of(9, offset=5)
    logits, generation = first_logits(engine, prompt)
    assert generation.stats.cached_tokens < 64  # part of the chain was evicted
    assert (logits - recomputed_logits(tiny_model, prompt)).abs().max() <= EXACT
    engine.pool.check_invariants()


def test_generated_tokens_are_stored_and_hit_on_the_next_turn(engine):
    prompt = prompt_of(40)
    first = engine.generate(prompt, max_new_tokens=30).result()
    assert first.stats.stored_blocks == 5  # 69 computed positions: 4 full blocks and a 5-token tail
    follow_up = prompt + first.token_ids + prompt_of(5, offset=9)
    second = engine.generate(follow_up, max_new_tokens=4).result()
    assert second.stats.cached_tokens == 40 + 30 - 1  # all but the last generated token, never fed back
    assert second.stats.prefill_tokens == len(follow_up) - 69


def test_prefix_and_stateless_modes_produce_identical_greedy_tokens(make_engine):
    pooled, stateless = make_engine(), make_engine()
    history: list[int] = []
    for turn in range(5):
        history += prompt_of(11 + turn, offset=turn)
        a = pooled.generate(history, max_new_tokens=12).result()
        b = stateless.generate(history, max_new_tokens=12, use_pool=False).result()
        assert a.token_ids == b.token_ids
        history += a.token_ids
    assert stateless.stats.cached_tokens == 0
    assert pooled.stats.cached_tokens > 0


def test_stats_add_up_per_call_and_cumulatively(engine):
    generations = [engine.generate(prompt_of(50), max_new_tokens=5).result() for _ in range(3)]
    for generation in generations:
        stats = generation.stats
        assert stats.cached_tokens + stats.prefill_tokens == stats.prompt_tokens == 50
        assert stats.generated_tokens == 5
        assert stats.ttft_s > 0 and stats.total_s >= stats.ttft_s
    total = engine.stats
    assert total.calls == 3
    assert total.prompt_tokens == 150
    assert total.cached_tokens == sum(g.stats.cached_tokens for g in generations) == 98  # 0 + 49 + 49
    assert total.hit_rate == pytest.approx(98 / 150)


def test_sampling_is_reproducible_with_a_seed(engine):
    prompt = prompt_of(20)
    runs = [engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=5).result().token_ids for _ in range(2)]
    other = engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=6).result().token_ids
    assert runs[0] == runs[1]
    assert other != runs[0]
    nucleus = engine.generate(prompt, max_new_tokens=16, temperature=1.0, top_p=1e-6, seed=5).result()
    greedy = engine.generate(prompt, max_new_tokens=16).result()
    assert nucleus.token_ids == greedy.token_ids  # a vanishing nucleus keeps only the top token


def test_stop_token_ids_end_generation_with_reason_stop(engine):
    greedy = engine.generate(prompt_of(20), max_new_tokens=8).result()
    stopping = engine.generate(prompt_of(20), max_new_tokens=8, stop_token_ids=[greedy.token_ids[2]]).result()
    assert stopping.finish_reason == "stop"
    assert stopping.token_ids == greedy.token_ids[: greedy.token_ids.index(greedy.token_ids[2]) + 1]
    assert greedy.finish_reason == "length"


def test_stop_strings_end_generation(engine, tiny_tok):
    greedy = engine.generate(prompt_of(20), max_new_tokens=8, temperature=1.0, seed=1).result()
    marker = tiny_tok.decode(greedy.token_ids[3:5])
    stopped = engine.generate(prompt_of(20), max_new_tokens=8, temperature=1.0, seed=1, stop=[marker]).result()
    assert stopped.finish_reason == "stop"
    assert marker in stopped.text
    assert len(stopped.token_ids) <= 5


def test_streaming_yields_each_token_as_it_is_decoded(engine):
    generation = engine.generate(prompt_of(20), max_new_tokens=6)
    streamed = list(generation)
    assert streamed == generation.token_ids and len(streamed) == 6


def test_closing_a_stream_early_stores_what_was_computed_and_holds_nothing(engine):
    generation = engine.generate(prompt_of(30), max_new_tokens=40)
    for count, _ in enumerate(generation, start=1):
        if count == 20:
            break
    generation.close()
    assert generation.stats.stored_blocks == 4  # 49 computed positions: 3 full blocks and a 1-token tail
    assert engine.pool.stats().blocks_in_use == 0
    engine.pool.check_invariants()


def test_hold_blocks_hands_the_chain_to_the_caller(engine):
    generation = engine.generate(prompt_of(40), max_new_tokens=9, hold_blocks=True).result()
    chain = generation.block_ids
    assert len(chain) == 3
    assert engine.pool.ref_counts(chain) == [1, 1, 1]
    engine.pool.release(list(reversed(chain)))
    assert engine.pool.stats().blocks_in_use == 0


def test_a_request_larger_than_the_pool_fails_before_computing_and_holds_nothing(make_engine):
    engine = make_engine(max_blocks=4)
    engine.generate(prompt_of(33), max_new_tokens=0).result()
    # 81 positions: 6 blocks, 2 of them cached, in a pool of 4: too large whatever is released
    with pytest.raises(PoolTooSmallError, match="needs 81 positions in 6 KV blocks of 16 tokens; the pool has 4"):
        engine.generate(prompt_of(33) + prompt_of(40), max_new_tokens=8).result()
    assert engine.pool.stats().blocks_in_use == 0
    assert engine.stats.calls == 1  # refused at admission, as a prompt over the window is
    engine.pool.check_invariants()


def test_a_request_the_busy_pool_cannot_hold_now_fails_before_computing_and_holds_nothing(make_engine):
    engine = make_engine(max_blocks=4)
    held = engine.pool.allocate(3)  # another request's room
    with pytest.raises(PoolExhaustedError, match="cannot supply 2 blocks"):
        engine.generate(prompt_of(20), max_new_tokens=8).result()
    assert engine.pool.stats().blocks_in_use == 3
    assert engine.stats.calls == 1  # the failed call is counted, with nothing computed
    engine.pool.release(held)
    engine.pool.check_invariants()


def test_invalid_requests_name_the_field(engine):
    with pytest.raises(ConfigError, match="prompt_token_ids"):
        engine.generate([])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.generate([1, 99999])
    with pytest.raises(ConfigError, match="temperature"):
        engine.generate([1, 2], temperature=-1)
    with pytest.raises(ConfigError, match="top_p"):
        engine.generate([1, 2], top_p=0)
    with pytest.raises(ContextWindowError, match="positions"):
        engine.generate(prompt_of(4000), max_new_tokens=200)


def test_threads_sharing_a_prefix_produce_the_same_tokens_as_a_sequential_run(make_engine):
    shared = prompt_of(48)
    prompts = [shared + prompt_of(10 + i, offset=11 * i) for i in range(4)]
    sequential_engine = make_engine()
    expected = [sequential_engine.generate(p, max_new_tokens=12).result().token_ids for p in prompts]

    engine = make_engine()
    engine.generate(shared, max_new_tokens=0).result()
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            for _ in range(3):
                results[index] = engine.generate(prompts[index], max_new_tokens=12).result().token_ids
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [results[i] for i in range(4)] == expected
    assert engine.pool.stats().blocks_in_use == 0
    engine.pool.check_invariants()


def test_a_cache_hit_serves_the_log_probs_the_computing_call_measured(make_engine):
    from clm_middleware.engine import Observe

    engine = make_engine()
    prompt = list(b"The measured log-probs travel with the cached blocks of a prefix. " * 2)
    positions = frozenset(range(1, len(prompt), 3))
    first = engine.generate(prompt, max_new_tokens=1, observe=Observe(logprobs=True, logprob_positions=positions))
    first = first.result()
    second = engine.generate(prompt, max_new_tokens=1, observe=Observe(logprobs=True, logprob_positions=positions))
    second = second.result()
    assert second.stats.cached_tokens > len(prompt) // 2  # served from the pool
    assert [v is None for v in second.prompt_logprobs] == [v is None for v in first.prompt_logprobs]
    for a, b in zip(first.prompt_logprobs, second.prompt_logprobs, strict=True):
        assert a is None or abs(a - b) < 1e-4


def test_a_dropped_engine_is_freed_without_a_cycle_collection(make_either_engine):
    """Nothing an engine owns refers back to it strongly (its runner, arenas, cache layers):
    dropping the last reference frees the pool and arenas at once, without the cycle
    collector (a process making sibling engines stays flat)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        engine = make_either_engine(max_blocks=64)
        engine.generate(prompt_of(40), max_new_tokens=3).result()
        engine.generate(prompt_of(60), max_new_tokens=3).result()
        alive = [weakref.ref(engine), weakref.ref(engine.pool)]
        del engine
        assert [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()


def test_a_generation_dropped_mid_call_and_collected_leaves_the_engine_usable(make_either_engine):
    """Collected in one garbage cycle with its arena, a dropped generation's ``finally``
    ran after the arena's layers had lost it; the arena went back to the spares, and
    every later call on the engine failed with ReferenceError."""
    import gc

    engine = make_either_engine(max_blocks=64)
    expected = engine.generate(prompt_of(20), max_new_tokens=3).result().token_ids
    dropped = iter(engine.generate(prompt_of(40), max_new_tokens=20))
    next(dropped)
    del dropped
    gc.collect()
    assert engine.pool.stats().blocks_in_use == 0
    assert engine.generate(prompt_of(20), max_new_tokens=3).result().token_ids == expected


def test_a_forced_reply_past_the_window_is_named_as_the_forced_reply_not_max_new_tokens(engine):
    window = engine.max_positions
    with pytest.raises(ContextWindowError, match=r"plus the forced reply \(") as raised:
        engine.generate([1] * (window - 2), max_new_tokens=4, forced_token_ids=[5] * 8).result()
    assert "max_new_tokens" not in str(raised.value) + (raised.value.hint or "")


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids"),
        ({"forced_token_ids": ["7"]}, "forced_token_ids"),
    ],
)
def test_generate_refuses_arguments_that_cannot_work_naming_them(engine, arguments, field):
    call = {"prompt_token_ids": [1, 2, 3], "max_new_tokens": 2, **arguments}
    with pytest.raises(ConfigError, match=rf"^{field}:"):
        engine.generate(**call).result()
