"""The lifecycle layer in front of a real llama.cpp server (llama-server, SmolLM2 GGUF).

Every request loop here is bounded in count (the transcript's turns, a few chats) and
in time (the client's timeouts, the server fixture's start deadline).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from clm_middleware.cli.main import cli
from clm_middleware.conversation import Conversation
from clm_middleware.engine.protocol import ServingEngine
from clm_middleware.errors import ConfigError
from clm_middleware.remote import ClientConfig, RemoteEngine, RemoteEngineError
from clm_middleware.render.chat_format import ChatFormat
from clm_middleware.store import Store

pytestmark = pytest.mark.remote

REPO = Path(__file__).resolve().parents[2]
LISBON = REPO / "examples/transcripts/lisbon_trip.jsonl"
PARITY_TURNS = 6
REPLY_TOKENS = 24
LOOP_FLAGS = {"repetition_loop", "repeats_earlier_reply"}  # such a reply may leave the context at once
LONG_PROMPT_TOKENS = 512  # a new message here (and its header) is ≤ ~50 tokens
# most of this chat's replies repeat an earlier one and leave the context: at 1024 its context
# stayed under the budget (901 tokens at the last turn), and no compaction ran
REPLAY_BUDGET = 640


@pytest.fixture(scope="module")
def remote(llama_server, smollm2_tokenizer) -> RemoteEngine:
    return RemoteEngine(llama_server.url, smollm2_tokenizer, signals="none")


def test_remote_engine_satisfies_the_engine_protocol_and_reads_the_server(remote):
    assert isinstance(remote, ServingEngine)
    assert remote.info.dialect == "llamacpp"
    assert remote.info.num_slots == 2
    assert remote.tokenizer_checked
    assert remote.signals_source == "none"


def test_a_server_with_another_tokenizer_is_refused_at_start(llama_server, tiny_tok):
    with pytest.raises(RemoteEngineError, match="tokenizer"):
        RemoteEngine(llama_server.url, tiny_tok)


def test_generate_streams_token_ids_and_the_next_prompt_hits_the_servers_cache(remote, smollm2_tokenizer):
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, return_dict=False
    )
    first = remote.generate(prompt, max_new_tokens=REPLY_TOKENS)
    streamed = list(first)
    assert streamed == first.token_ids and streamed
    assert first.stats.prompt_tokens == len(prompt)
    follow = prompt + first.token_ids + smollm2_tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd two more?")
    second = remote.generate(follow, max_new_tokens=4).result()
    # the server kept prompt + reply in the same slot: all of it is reused
    assert second.stats.cached_tokens >= len(prompt) + len(first.token_ids) - 1


def test_a_reply_of_characters_split_over_tokens_keeps_every_id_and_its_text(remote, smollm2_tokenizer):
    # llama.cpp streams "あ" (two tokens) as one event naming only the second one
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say ありがとう three times."}], add_generation_prompt=True, return_dict=False
    )
    generation = remote.generate(prompt, max_new_tokens=12)
    ids = list(generation)
    bare = httpx.post(
        f"{remote.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
        timeout=120,
    ).json()
    text = bare["choices"][0]["text"]
    assert "\ufffd" not in smollm2_tokenizer.decode(ids) and smollm2_tokenizer.decode(ids) == text
    assert len(ids) == generation.stats.generated_tokens == bare["usage"]["completion_tokens"]
    # llama.cpp names no withheld id unstreamed either; here the model wrote the text as
    # the tokenizer splits it
    assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)


def test_a_call_for_the_prompts_signals_alone_never_reaches_the_server(llama_server, smollm2_tokenizer, smollm2_scorer):
    # the compressor scores its candidates so (max_new_tokens=0): a request each took a
    # slot from a conversation and prefilled on the server for nothing
    from clm_middleware.engine.observe import Observe

    remote = RemoteEngine(llama_server.url, smollm2_tokenizer, scorer=smollm2_scorer)

    def computed() -> float:
        lines = httpx.get(f"{llama_server.url}/metrics", timeout=30).text.splitlines()
        return sum(float(line.split()[1]) for line in lines if line.startswith("llamacpp:prompt_tokens_total"))

    before = computed()
    prompt = smollm2_tokenizer.encode("The gate code is 5521 and the bus leaves at nine.")
    scored = remote.generate(prompt, max_new_tokens=0, use_pool=False, observe=Observe(logprobs=True)).result()
    assert computed() == before
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(prompt)
    assert scored.token_ids == [] and scored.stats.prompt_tokens == len(prompt)


def test_a_budget_over_a_servers_slot_is_refused_when_the_conversation_starts(remote):
    slot = remote.max_positions  # llama-server: --ctx-size divided by --parallel
    with pytest.raises(ConfigError, match=rf"budget: {slot + 64} tokens is over the {slot} positions") as raised:
        Conversation(remote, budget=slot + 64)
    assert "--parallel" in (raised.value.hint or "")
    with pytest.warns(RuntimeWarning, match=r"no room for a reply of up to 256 tokens"):
        Conversation(remote, budget=slot).close()  # every reply near the budget was cut at the slot's end
    Conversation(remote, budget=slot - 256).close()


def test_decode_time_is_measured_also_when_the_caller_closes_the_stream_early(remote, smollm2_tokenizer):
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from one to twenty in words."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    generation = remote.generate(prompt, max_new_tokens=REPLY_TOKENS)
    taken = list(itertools.islice(generation, 6))
    generation.close()  # as a reply cut by the lifecycle, or a stream whose client left, is
    assert len(taken) == 6
    assert generation.stats.decode_s > 0  # it was 0: the decode rate of a clm replay read 0 tok/s


def test_replay_through_the_engine_hits_the_servers_cache_on_turns_without_a_compaction(
    llama_server, smollm2_tokenizer, tmp_path
):
    report_path = tmp_path / "clm.json"
    args = [
        "replay",
        str(LISBON),
        "--engine",
        f"openai:{llama_server.url}",
        "--mode",
        "clm",
        "--budget",
        str(REPLAY_BUDGET),
        "--tagging",
        "signals",
        "--max-new-tokens",
        str(REPLY_TOKENS),
        "--report",
        str(report_path),
        "--quiet",
    ]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["settings"]["dialect"] == "llamacpp"
    assert report["settings"]["signals_source"].startswith("scorer:")
    turns = report["turns"]
    assert len(turns) == 34
    # a turn without a compaction or a restore extends the previous prompt (and reply), so
    # the server recomputes only the new message: all of the previous prompt is reused, but
    # the generation prompt when the previous reply left the context at once as a loop (it
    # stays in its own slot: once it moved to an empty one and re-prefilled everything)...
    # (a restored segment goes back at its old place: llama.cpp recomputes from there on,
    # where the local pool reuses its blocks)
    header = len(ChatFormat.from_tokenizer(smollm2_tokenizer).generation_prompt_ids)
    steady = [(b, t) for b, t in itertools.pairwise(turns) if not t["compaction"] and not t["restored"]]
    assert len(steady) >= 10
    for before, turn in steady:
        dropped = LOOP_FLAGS & set(before["reply_flags"])
        assert turn["cached_tokens"] >= before["prompt_tokens"] - (header if dropped else 0), turn
    # ... which, once the context is long (a new message is then < 10% of it), is ≥ 90% of the prompt
    long = [t for _, t in steady if t["prompt_tokens"] >= LONG_PROMPT_TOKENS]
    assert len(long) >= 5
    for turn in long:
        assert turn["cached_tokens"] >= 0.9 * turn["prompt_tokens"], turn
    assert any(t["compaction"] for t in turns)  # the budget did act
    assert max(t["context_tokens"] for t in turns[5:]) <= REPLAY_BUDGET + 2 * REPLY_TOKENS
    # the scorer labelled every turn, those whose reply the token cap or a repeat ended too
    assert any(t["generated_tokens"] == REPLY_TOKENS or "repetition_cut" in t["reply_flags"] for t in turns)
    assert {t["tagging_mode"] for t in turns} == {"signals"}


def _chat_reply(url: str, messages: list[dict[str, str]]) -> str:
    body = {"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0.0}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120.0).json()
    return answer["choices"][0]["message"]["content"]


def test_prefix_mode_greedy_replies_equal_llama_cpps_own_chat_completion(llama_server, tmp_path):
    report_path = tmp_path / "prefix.json"
    transcript = _lisbon_head(tmp_path, PARITY_TURNS)
    head = [json.loads(line) for line in transcript.read_text().splitlines() if line.strip()]
    args = ["replay", str(transcript), "--engine", f"openai:{llama_server.url}", "--engine-signals", "none"]
    args += ["--mode", "prefix", "--max-new-tokens", str(REPLY_TOKENS), "--report", str(report_path), "--quiet"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    ours = [t["reply"] for t in json.loads(report_path.read_text())["turns"]]
    assert len(ours) == PARITY_TURNS
    messages: list[dict[str, str]] = []
    theirs = []
    for row in head:
        if row["role"] == "assistant":
            reply = _chat_reply(llama_server.url, messages)
            theirs.append(reply)
            messages.append({"role": "assistant", "content": ours[len(theirs) - 1]})  # the history ours saw
        else:
            messages.append({"role": row["role"], "content": row["content"]})
    assert all(r.strip() for r in ours)
    assert [r.strip() for r in ours] == [r.strip() for r in theirs]


def _lisbon_head(tmp_path: Path, turns: int) -> Path:
    """The bundled transcript's first ``turns`` user turns (and what they were answered)."""
    rows = [json.loads(line) for line in LISBON.read_text().splitlines() if line.strip()]
    head, users = [], 0
    for row in rows:
        users += row["role"] == "user"
        if users > turns:
            break
        head.append(row)
    path = tmp_path / f"lisbon_{turns}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in head) + "\n")
    return path


def test_server_signals_from_llama_cpp_are_refused_naming_the_setting(llama_server, smollm2_tokenizer):
    with pytest.raises(ConfigError, match=r"engine_signals: .*vLLM only"):
        RemoteEngine(llama_server.url, smollm2_tokenizer, signals="server")


def test_a_scorer_with_a_tokenizer_of_its_own_labels_through_the_server(llama_server, tmp_path):
    """The tiny model (byte tokens) scores for SmolLM2's tokens, aligned by characters."""
    report_path = tmp_path / "aligned.json"
    args = ["replay", str(_lisbon_head(tmp_path, 8)), "--engine", f"openai:{llama_server.url}"]
    args += ["--engine-scorer", "tiny", "--mode", "clm", "--budget", "256", "--tagging", "signals"]
    args += ["--max-new-tokens", "8", "--teacher-force", "--report", str(report_path), "--quiet"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["settings"]["signals_source"] == "scorer:tiny-llama-seed0"
    assert report["settings"]["scorer_alignment"] == "characters"
    turns = report["turns"]
    assert len(turns) == 8 and all(t["reply_nll"] is not None and t["reply_nll"] > 0 for t in turns)
    assert any(t["compaction"] for t in turns)  # the budget acted on labels and values the scorer gave
    assert max(t["context_tokens"] for t in turns) <= 256 + 64


def test_bench_through_the_engine_compares_modes_on_the_servers_cache(llama_server, tmp_path):
    markdown, transcript = tmp_path / "bench.md", _lisbon_head(tmp_path, 4)
    probes = LISBON.with_name("lisbon_trip.probes.json")
    transcript.with_name("lisbon_4.probes.json").write_text(probes.read_text())  # found beside the file
    args = ["bench", str(transcript), "--engine", f"openai:{llama_server.url}"]
    args += ["--engine-signals", "none", "--modes", "prefix,clm", "--tagging", "rules", "--max-new-tokens", "8"]
    args += ["--markdown", str(markdown), "--report-dir", str(tmp_path / "bench")]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = markdown.read_text()
    assert "| metric | prefix | clm |" in text and "cached tokens" in text and "facts retained" in text
    for mode in ("prefix", "clm"):
        turns = json.loads((tmp_path / "bench" / f"{mode}.json").read_text())["turns"]
        assert len(turns) == 4 and sum(t["cached_tokens"] for t in turns[1:]) > 0


def test_clm_chat_through_the_engine_answers_and_shows_the_servers_cache(llama_server):
    args = ["chat", "--engine", f"openai:{llama_server.url}", "--engine-signals", "none", "--tagging", "rules"]
    args += ["--max-new-tokens", "8"]
    result = CliRunner().invoke(cli, args, input="My code is QX-4471.\nWhat was it?\n/stats\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "cached" in result.output


def test_chatclm_with_engine_url_answers_through_the_server_and_reads_its_cache(llama_server):
    from langchain_core.messages import AIMessage, HumanMessage

    from clm_middleware.adapters import ChatCLM

    llm = ChatCLM(engine_url=f"openai:{llama_server.url}", engine_signals="none", tagging="rules", max_tokens=8)
    history = [HumanMessage("My booking code is QX-4471.")]
    first = llm.invoke(history)
    second = llm.invoke([*history, AIMessage(first.content), HumanMessage("What was my code?")])
    assert first.content.strip() and second.content.strip()
    assert second.response_metadata["conversation_id"] == first.response_metadata["conversation_id"]
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0


def test_after_a_tool_result_a_reply_through_the_server_opens_no_copied_call(llama_server):
    """Where no tool may be called, the server is sent a ban (logit_bias) on the tokens that
    open one: SmolLM2 had copied the call before the result as text."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from clm_middleware.adapters import ChatCLM

    llm = ChatCLM(engine_url=f"openai:{llama_server.url}", engine_signals="none", tagging="rules", max_tokens=24)
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}
    history = [HumanMessage("Weather in Paris?"), AIMessage("", tool_calls=[call])]
    reply = llm.invoke([*history, ToolMessage("Rain, 12°C in Paris.", tool_call_id="call_1")])
    assert reply.content.strip() and "<" not in reply.content and not reply.tool_calls, reply


@contextlib.contextmanager
def serving_in_front(llama_server, tmp_path: Path, max_tokens: int) -> Iterator[tuple[Any, str]]:
    """``clm serve`` on loopback in front of the llama-server, and the openai client for it
    with the served model's id; the server stops when the block ends."""
    from live_server import start_server
    from openai import OpenAI

    args = ("--engine", f"openai:{llama_server.url}", "--engine-signals", "none", "--max-tokens", str(max_tokens))
    live = start_server(tmp_path, *args, model=None)
    try:
        client = OpenAI(base_url=live.api, api_key="unused", timeout=120, max_retries=0)
        yield client, client.models.list().data[0].id
    finally:
        live.stop()


def test_clm_serve_in_front_of_the_engine_answers_the_openai_client(llama_server, tmp_path):
    with serving_in_front(llama_server, tmp_path, max_tokens=8) as (client, model):
        messages = [{"role": "user", "content": "Name a colour."}]
        first = client.chat.completions.create(model=model, messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "And another one?"}]
        second = client.chat.completions.create(model=model, messages=messages)
        assert second.choices[0].message.content.strip()
        assert second.usage.prompt_tokens_details.cached_tokens > 0  # the server's own count


def test_conversations_sharing_a_long_system_prompt_each_extend_their_own_slot(remote):
    system = "You are the help desk of a large airline. " + "Answer politely, briefly and only about flights. " * 40
    chats = [Conversation(remote, system_prompt=system, tagging="rules", max_new_tokens=8) for _ in range(2)]
    questions = ["Can I bring a bicycle?", "And a surfboard?", "What about a cat?"]
    for turn, question in enumerate(questions):
        for chat in chats:  # taking turns, as two users of one server do
            reply = chat.send(question)
            if turn:  # its own slot holds its last prompt and reply: only the new message is computed
                assert reply.stats.prefill_tokens < 40, (turn, reply.stats)
    for chat in chats:
        chat.close()


def test_a_tenant_never_hits_the_prompt_another_tenant_left_in_a_slot(remote, smollm2_tokenizer):
    secret = smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": "The vault code is 7731-ZETA."}, {"role": "user", "content": "Hello."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    alice = remote.generate(secret, max_new_tokens=4, cache_salt="alice").result()
    bob = remote.generate(secret, max_new_tokens=4, cache_salt="bob").result()
    assert bob.stats.cached_tokens == 0  # the same prompt, but alice's: computed afresh
    again = remote.generate(secret + alice.token_ids, max_new_tokens=4, cache_salt="alice").result()
    assert again.stats.cached_tokens >= len(secret)  # her own slot still serves her


def test_logit_bias_reaches_the_server(remote, smollm2_tokenizer):
    from clm_middleware.engine.penalties import LogitBias

    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, return_dict=False
    )
    plain = remote.generate(prompt, max_new_tokens=1, use_pool=False).result()
    banned = plain.token_ids[0]
    biased = remote.generate(
        prompt, max_new_tokens=1, use_pool=False, logits_processors=[LogitBias(((banned, -100.0),))]
    ).result()
    assert biased.token_ids and biased.token_ids[0] != banned


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_a_response_format_is_enforced_by_the_servers_own_grammar(remote):
    chat = Conversation(remote, tagging="rules", max_new_tokens=48, response_format={"type": "json_object"})
    document = json.loads(chat.send("Describe a cat.").text)
    assert isinstance(document, dict)
    chat.close()
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = Conversation(remote, tagging="rules", max_new_tokens=48, response_format=schema)
    person = json.loads(chat.send("Give me a person.").text)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    chat.add("user", "Another one.")
    with pytest.raises(ConfigError, match="reply_prefix"):  # the server's grammar starts after it
        chat.respond(reply_prefix='{"name": "')
    assert json.loads(chat.respond().text)["name"]  # the refused turn lost no message
    chat.close()


def test_clm_serve_in_front_of_the_engine_answers_a_json_schema_request(llama_server, tmp_path):
    with serving_in_front(llama_server, tmp_path, max_tokens=48) as (client, model):
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Give me a person."}], response_format=fmt
        )
        person = json.loads(reply.choices[0].message.content)
        assert isinstance(person["name"], str) and isinstance(person["age"], int)


def test_a_server_killed_mid_turn_gives_a_clear_error_and_loses_no_message(llama_server, smollm2_tokenizer, tmp_path):
    config = ClientConfig(llama_server.url, retry_attempts=2, read_timeout_s=60.0)
    remote = RemoteEngine(llama_server.url, smollm2_tokenizer, signals="none", client_config=config)
    db = tmp_path / "store.db"
    conversation = Conversation(remote, tagging="rules", max_new_tokens=12, store=str(db), system_prompt="Be brief.")
    conversation.send("My booking code is QX-4471. Please remember it.")
    conversation.send("Which city is the Tower of Belem in?")
    stored_before = len(Store(db).rows("messages", conversation.id, "idx"))
    assert stored_before == 5  # system, two users, two replies
    long_message = "Here is my whole itinerary again, day by day. " + "We walk, eat and look at tiles. " * 300
    killer = threading.Timer(0.5, llama_server.process.kill)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RemoteEngineError) as raised:
            conversation.send(long_message)
    finally:
        killer.cancel()
        llama_server.process.wait(timeout=15)
    assert time.monotonic() - started < 60
    assert llama_server.url.split("//")[1] in str(raised.value)
    stored = Store(db).rows("messages", conversation.id, "idx")
    assert len(stored) == stored_before  # every answered message is still there
    assert conversation.messages[-1].content == long_message  # the unanswered one is kept in memory
    assert conversation.turn == 2  # the failed turn was undone
    # the server comes back on the same address: the pending message is answered, then stored
    llama_server.start(tmp_path, port=llama_server.port)
    conversation.respond()
    assert len(Store(db).rows("messages", conversation.id, "idx")) == stored_before + 2
