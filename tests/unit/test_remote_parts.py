"""The remote engine's parts that need no server: URLs, request bodies, event parsing,
slot choice, the empty pool; and a refused connection (a real one: nothing listens)."""

from __future__ import annotations

import socket

import pytest
from loopback_http import LoopbackServer, send

from clm_middleware.engine import Engine
from clm_middleware.engine.penalties import CountPenalty, LogitBias, NoRepeatNgram, RepetitionPenalty
from clm_middleware.engine.protocol import KVPool, ServingEngine, signals_source
from clm_middleware.errors import ConfigError
from clm_middleware.remote import ClientConfig, RemoteEngine, RemoteEngineError, parse_engine_url
from clm_middleware.remote.client import ServerClient
from clm_middleware.remote.completion import completion_body, parse_event, penalty_fields
from clm_middleware.remote.null_pool import NullPool
from clm_middleware.remote.slots import SlotClaim, SlotTable
from clm_middleware.remote.token_bytes import TokenBytes
from clm_middleware.structured import ResponseFormat
from clm_middleware.structured.server_side import ServerFormat


def test_the_local_engine_satisfies_the_protocol(engine: Engine):
    assert isinstance(engine, ServingEngine)
    assert isinstance(engine.pool, KVPool)
    assert signals_source(engine) == "local"


@pytest.mark.parametrize(
    ("spec", "url"),
    [
        ("openai:http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("openai:http://gpu-1:8000/v1/", "http://gpu-1:8000"),
        ("https://fleet.example/v1", "https://fleet.example"),
    ],
)
def test_engine_urls_name_the_server_root(spec, url):
    assert parse_engine_url(spec) == url


def test_an_engine_url_without_a_scheme_is_a_config_error():
    with pytest.raises(ConfigError, match="engine"):
        parse_engine_url("openai:localhost:8080")


def _body(dialect: str, **overrides):
    settings = dict(
        model="m",
        dialect=dialect,
        prompt=[1, 2, 3],
        max_tokens=8,
        temperature=0.0,
        top_p=1.0,
        top_k=None,
        min_p=None,
        seed=None,
        stop=(),
        cache_prompt=True,
        slot=1,
        prompt_logprobs=True,
        extra={},
    )
    settings.update(overrides)
    return completion_body(**settings)


def test_a_llama_cpp_body_keeps_its_slot_and_cache_and_asks_for_token_ids():
    body = _body("llamacpp")
    assert body["prompt"] == [1, 2, 3]
    assert body["cache_prompt"] is True and body["id_slot"] == 1 and body["n_probs"] == 1
    assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    assert body["timings_per_token"] is True
    assert "prompt_logprobs" not in body and "stop" not in body


def test_a_vllm_body_asks_for_token_ids_and_prompt_logprobs_and_names_no_slot():
    body = _body("vllm", stop=("\n\n",), seed=3)
    assert body["return_token_ids"] is True and body["prompt_logprobs"] == 0
    assert "id_slot" not in body and "cache_prompt" not in body
    assert body["stop"] == ["\n\n"] and body["seed"] == 3


def test_llama_cpp_events_give_token_ids_logprobs_and_the_cache_count():
    partial = {
        "choices": [{"text": "Hi", "finish_reason": None, "logprobs": {"content": [{"id": 42, "logprob": -0.5}]}}]
    }
    final = {
        "choices": [{"text": "", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 30, "prompt_tokens_details": {"cached_tokens": 28}},
        "timings": {"cache_n": 28, "prompt_n": 2},
    }
    first, last = parse_event(partial), parse_event(final)
    assert (first.token_ids, first.token_logprobs, first.text) == ([42], [-0.5], "Hi")
    assert (last.finish_reason, last.prompt_tokens, last.cached_tokens) == ("stop", 30, 28)
    assert parse_event({"timings": {"cache_n": 7}}).cached_tokens == 7
    assert parse_event({"tokens_cached": 5}).cached_tokens == 5
    assert parse_event({"timings": {"predicted_n": 3}}).generated_so_far == 3


def test_ids_a_stream_withheld_inside_a_character_are_put_back_from_its_bytes(tiny_tok):
    # llama.cpp sends a character split over tokens as one event naming only the last
    # token; the tiny vocabulary has one token per byte, so "あ" is three
    char = tiny_tok.encode("あ", add_special_tokens=False)
    assert len(char) == 3
    vocabulary = TokenBytes(tiny_tok)
    assert vocabulary.withheld("あ", char[-1:], 2) == char[:2]
    assert vocabulary.withheld("xあ", char[-1:], 3) == [*tiny_tok.encode("x"), *char[:2]]
    # bytes no split into that many tokens fits, or a named tail the text does not end with
    assert vocabulary.withheld("あ", char[-1:], 1) is None
    assert vocabulary.withheld("あ", tiny_tok.encode("z"), 2) is None


def test_vllm_events_give_token_ids_and_the_prompts_own_logprobs():
    event = parse_event(
        {
            "choices": [
                {
                    "text": "a",
                    "token_ids": [9, 10],
                    "prompt_logprobs": [None, {"5": {"logprob": -1.5, "rank": 3}}],
                    "finish_reason": None,
                }
            ]
        }
    )
    assert event.token_ids == [9, 10] and event.prompt_logprobs == [None, -1.5]


def test_penalties_become_the_servers_own_fields_and_other_processors_are_refused():
    assert penalty_fields([RepetitionPenalty(1.3), CountPenalty(0.2, 0.1)], "llamacpp") == {
        "repeat_penalty": 1.3,
        "frequency_penalty": 0.2,
        "presence_penalty": 0.1,
    }
    assert penalty_fields([RepetitionPenalty(1.3)], "vllm") == {"repetition_penalty": 1.3}
    with pytest.raises(ConfigError, match="no_repeat_ngram_size"):
        penalty_fields([NoRepeatNgram(3)], "llamacpp")
    with pytest.raises(ConfigError, match="logits"):
        penalty_fields([lambda ids, logits: logits], "vllm")


def test_logit_bias_goes_to_the_server_in_its_own_format():
    bias = LogitBias(((5, -100.0), (9, 2.5)))
    assert penalty_fields([bias], "llamacpp") == {"logit_bias": [[5, -100.0], [9, 2.5]]}
    assert penalty_fields([bias], "vllm") == {"logit_bias": {"5": -100.0, "9": 2.5}}


PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_a_response_format_becomes_each_servers_own_grammar_field():
    schema = ServerFormat(ResponseFormat.from_schema(PERSON, name="person"))
    assert penalty_fields([schema], "llamacpp") == {"json_schema": PERSON}
    assert penalty_fields([schema], "vllm") == {"structured_outputs": {"json": PERSON}}
    assert penalty_fields([schema], "openai") == {
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    }
    any_object = ServerFormat(ResponseFormat.json_object())
    assert penalty_fields([any_object], "llamacpp") == {"json_schema": {"type": "object"}}
    assert penalty_fields([any_object], "openai") == {"response_format": {"type": "json_object"}}


def test_a_tool_calls_grammar_cannot_run_on_a_server_and_says_so():
    call = ResponseFormat.tool_call("lookup", {"type": "object", "properties": {}}, ("<tool_call>", "</tool_call>"))
    with pytest.raises(ConfigError, match="tool call"):
        ServerFormat(call)
    with pytest.raises(ConfigError, match="tool call"):
        ServerFormat(ResponseFormat.json_object().or_calls((call,)))
    with pytest.raises(ConfigError, match="serving engine"):
        ServerFormat(ResponseFormat.json_object())([1], None)  # never a local logits processor


def _served(slots: SlotTable, prompt: list[int], reply: list[int], salt: str | None = None) -> int:
    """Pick a slot for ``prompt`` and record it answered with ``reply``; the slot."""
    claim = slots.pick(prompt, salt)
    slots.record(claim, [*prompt, *reply])
    return claim.slot


def test_a_conversation_keeps_its_slot_turn_after_turn():
    slots = SlotTable(2)
    a1, b1 = [1, 2, 3, 5, 6], [1, 2, 9]  # same system prompt, different conversations
    assert _served(slots, a1, [4]) == 0
    assert _served(slots, b1, [8]) == 1  # an empty slot, not a's (which b would only partly reuse)
    assert slots.pick([*a1, 4, 5, 6]).slot == 0
    assert slots.pick([*b1, 8, 7]).slot == 1


def test_a_conversation_whose_reply_left_the_context_keeps_its_slot_while_others_are_empty():
    slots = SlotTable(4, generation_prompt_length=2)
    prompt = [1, 2, 3, 90, 91]  # 90, 91: the generation prompt opening the reply
    for _turn in range(3):  # each reply is a flagged repeat: the next prompt is all of the last but
        assert _served(slots, prompt, [7, 7]) == 0  # its generation prompt and reply, then a message
        prompt = [*prompt[:-2], 5, 6, 90, 91]
    assert _served(slots, prompt, [7]) == 0  # asked again (a regenerate): the same prompt, its own slot
    assert _served(slots, prompt, [8]) == 0
    assert _served(slots, [1, 2, 4, 90, 91], [9]) == 1  # a new conversation on the shared start: an empty slot


def test_conversations_sharing_a_long_system_prompt_each_keep_their_own_slot():
    system = list(range(100, 148))  # most of either slot's content
    a, b = [*system, 1], [*system, 2]
    assert _served(slots := SlotTable(2), a, [3]) == 0
    assert _served(slots, b, [4]) == 1  # not slot 0, which b would reuse 48 of 50 of
    for turn in range(3):  # taking turns, each extends its own slot: no re-prefill
        a, b = [*a, 3, 5 + turn], [*b, 4, 7 + turn]
        assert _served(slots, a[:-1], [a[-1]]) == 0
        assert _served(slots, b[:-1], [b[-1]]) == 1


def test_after_a_lifecycle_change_the_slot_reused_the_most_wins_and_no_slots_means_none():
    slots = SlotTable(2)
    _served(slots, [1, 2, 3, 4, 5, 6, 7], [8])  # a long history in 0
    _served(slots, [1, 2, 9], [9])  # a short managed context in 1
    assert _served(slots, [1, 2, 9, 5], []) == 1  # shares 3 of 4 there, 2 of 8 in slot 0
    assert _served(slots, [1, 2, 3, 4, 5, 6, 0], []) == 0  # its own slot after a change at the end
    assert SlotTable(0).pick([1]) is None


def test_a_busy_slot_is_not_sent_a_second_request_while_another_is_idle():
    slots = SlotTable(2)
    _served(slots, [1, 2, 3], [4])
    _served(slots, [7, 8], [9])
    running = slots.pick([1, 2, 3, 4, 5])  # extends slot 0, which stays busy until recorded
    assert running.slot == 0
    assert slots.pick([1, 2, 3, 4, 5, 6]).slot == 1  # slot 0 would queue it behind the first
    slots.record(running, [1, 2, 3, 4, 5, 6])


def test_a_slot_is_reused_only_by_the_tenant_that_filled_it():
    slots = SlotTable(2)
    secret = [1, 2, 3, 4, 5]
    first = slots.pick(secret, "alice")
    assert not first.reuse  # an empty slot under a salt: the server's own prompt cache is not trusted
    slots.record(first, [*secret, 6])
    bob = slots.pick(secret, "bob")
    assert bob.slot == 1 and not bob.reuse  # alice's slot is not his, and the empty one reuses nothing
    slots.record(bob, [*secret, 7])
    assert slots.pick([*secret, 6, 8], "alice") == SlotClaim(0, True)
    carol = slots.pick(secret, "carol")  # every idle slot is another tenant's: one is taken, cold
    assert not carol.reuse
    assert slots.pick([1], reuse=False).reuse is False  # a call that asks for no reuse gets none


def test_the_null_pool_holds_nothing_and_reports_zeros():
    pool = NullPool()
    pool.release([])
    pool.acquire([])
    assert pool.stats().blocks_in_use == 0 and pool.stats().kv_bytes == 0
    with pytest.raises(RuntimeError):
        pool.release([3])


def test_a_server_that_does_not_listen_is_a_clear_error_after_the_retries(tiny_tok):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RemoteEngineError, match="cannot reach") as raised:
        RemoteEngine(url, tiny_tok, client_config=ClientConfig(url, retry_attempts=2, connect_timeout_s=1.0))
    assert "2 tries" in str(raised.value) and "--engine" in str(raised.value)


class _Unavailable:
    """Answers 503 to its first ``failures`` GETs, then 200; counts them in ``requests``."""

    def __init__(self, failures: int) -> None:
        self.failures, self.requests = failures, 0

    def __call__(self, handler) -> None:
        self.requests += 1
        if self.requests <= self.failures:
            send(handler, 503, b"loading model", "text/plain")
        else:
            send(handler, 200, b'{"ok": true}', "application/json")


def test_a_503_is_retried_until_the_server_answers():
    unavailable = _Unavailable(failures=2)
    with LoopbackServer(on_get=unavailable) as server:
        client = ServerClient(ClientConfig(server.url, retry_attempts=3))
        assert client.get_json("/health") == {"ok": True}
        assert unavailable.requests == 3
        client.close()


def test_a_server_that_stays_unavailable_is_a_clear_error_naming_503():
    unavailable = _Unavailable(failures=10)
    with LoopbackServer(on_get=unavailable) as server:
        client = ServerClient(ClientConfig(server.url, retry_attempts=2))
        with pytest.raises(RemoteEngineError, match=r"unavailable \(503\) after 2 tries: loading model"):
            client.get_json("/health")
        assert unavailable.requests == 2
        client.close()


def test_a_web_server_that_is_no_engine_is_refused_at_start_naming_its_url():
    """A static file server on the engine's port had been taken for model "default", and
    every request then got its 404 page as an engine error (a helper's sweep)."""
    from clm_middleware.remote.server_info import read_server_info

    def not_found(handler) -> None:
        send(handler, 404, b"<html><body>Not Found</body></html>", "text/html")

    def models_only(handler) -> None:
        if handler.path == "/v1/models":
            send(handler, 200, b'{"data": [{"id": "smol"}]}', "application/json")
        else:
            not_found(handler)

    with LoopbackServer(on_get=not_found) as server:
        client = ServerClient(ClientConfig(server.url, retry_attempts=1))
        with pytest.raises(RemoteEngineError, match=rf"{server.url} answers none of GET /v1/models"):
            read_server_info(client, None)
        client.close()
    with LoopbackServer(on_get=models_only) as server:
        client = ServerClient(ClientConfig(server.url, retry_attempts=1))
        info = read_server_info(client, None)
        assert (info.dialect, info.model_id) == ("openai", "smol")
        client.close()


def test_every_engine_reports_the_disk_totals_a_report_names(engine):
    """A replay report's totals hold every disk total (zeros without a disk tier); the
    remote engine had returned four of the six, so its reports lacked the other two."""
    from clm_middleware.replay.report import DISK_TOTALS

    assert tuple(engine.disk_stats()) == DISK_TOTALS
    assert tuple(RemoteEngine.disk_stats(None)) == DISK_TOTALS  # no server needed: this side has no disk tier
