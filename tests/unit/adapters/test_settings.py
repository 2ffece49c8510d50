"""ChatCLM fails at construction, naming the argument, for what it cannot honour."""

import pytest
from langchain_core.messages import HumanMessage

from clm_middleware.adapters import ChatCLM
from clm_middleware.errors import ConfigError, ModelNotFoundError


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_ctx": 2048}, "num_ctx: ChatCLM has no such argument.*'budget'"),
        ({"base_url": "http://127.0.0.1:8000"}, "base_url: .*clm serve"),
        ({"temprature": 0.5}, "did you mean 'temperature'"),
        ({"budget": 0}, "budget: must be ≥ 64"),
        ({"tagging": "magic"}, "tagging: unknown mode"),
        ({"top_p": 0}, "top_p"),
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"seed": 2**70}, "seed: must be an integer in"),
        ({"max_tokens": 0}, "max_tokens: "),  # ChatCLM's name, not the library's max_new_tokens
        ({"quantization": "int3"}, "quantization"),
        # the engine's settings, refused before the first call loads the model
        ({"kv_dtype": "fp8"}, "kv_dtype: must be one of"),
        ({"block_size": 0}, "block_size: must be ≥ 1"),
        ({"max_kv_bytes": -5}, "max_kv_bytes: must be ≥ 1"),
        ({"dtype": "int7"}, "dtype: unknown dtype"),
        ({"device": "tpu"}, "device: unknown device"),
        ({"approximate_reuse": 2.0}, "approximate_reuse: must be in"),
        ({"approximate_reuse": 0.15, "paged_kv": True}, "paged_kv: approximate reuse"),
        # pydantic's own refusals, named as ours are
        ({"temperature": "warm"}, "temperature: input should be a valid number.*'warm'"),
        ({"max_tokens": 2.7}, "max_tokens: input should be a valid integer.*fractional part"),
    ],
)
def test_an_unknown_argument_or_a_bad_setting_fails_at_construction_with_a_config_error(arguments, message):
    with pytest.raises(ConfigError, match=message):
        ChatCLM(model="tiny", **arguments)


def test_quantized_weights_get_their_own_shared_engine():
    from clm_middleware.models.quantization import model_quantization

    def model_of(chat: ChatCLM):
        reply = chat.invoke("hi")
        assert reply.response_metadata["turn"] == 1
        return chat.conversation(reply.response_metadata["conversation_id"]).engine.model

    quantized, plain = ChatCLM(model="tiny", max_tokens=4, quantization="int4"), ChatCLM(model="tiny", max_tokens=4)
    assert model_quantization(model_of(quantized)) == "int4"
    assert model_quantization(model_of(plain)) is None


def test_a_model_path_that_is_not_there_fails_at_construction(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        ChatCLM(model=str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda chat: chat.invoke("hi", temprature=0.5), "temprature: a call of ChatCLM .*did you mean 'temperature'"),
        (lambda chat: chat.bind(num_predict=5).invoke("hi"), "num_predict: .*'max_tokens'"),
        (lambda chat: list(chat.stream("hi", logprobs=True)), "logprobs: a call of ChatCLM takes no such argument"),
    ],
)
def test_an_unknown_per_call_argument_fails_before_the_turn(call, message):
    chat = ChatCLM(model="tiny", max_tokens=4)
    with pytest.raises(ConfigError, match=message):
        call(chat)
    reply = chat.invoke("hi", temperature=0.0, repeat_penalty=1.1)  # known names, aliases too
    assert reply.response_metadata["turn"] == 1  # the refused call left no turn behind


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_tokens": 2.7}, "max_tokens: input should be a valid integer.*fractional"),
        ({"min_p": "a tenth"}, "min_p: input should be a valid number"),
        ({"repetition_penalty": [1.2]}, "repetition_penalty: "),
        ({"top_k": True}, "top_k: must be a number"),
        ({"parallel_tool_calls": "maybe"}, "parallel_tool_calls: must be true or false"),
        ({"tools": "get_weather"}, "tools: must be a list of tools"),
        ({"tools": [5]}, r"tools\[0\]: Unsupported function"),
        ({"tools": [{"name": "f", "parameters": {"type": "object", "required": "a"}}]}, "parameters.required"),
        ({"tool_choice": "required"}, "tool_choice"),  # required, with no tool bound
    ],
)
def test_a_bad_per_call_setting_or_tool_is_a_config_error_naming_it_before_the_turn(scripted_llm, arguments, message):
    llm, _ = scripted_llm("Fine.")
    with pytest.raises(ConfigError, match=message):
        llm.invoke("hi", **arguments)
    # as the constructor reads them; "false" is false, as clm serve's request schema reads it
    assert llm.invoke("hi", max_tokens=2.0, min_p="0.1", parallel_tool_calls="false").response_metadata["turn"] == 1


def test_a_stop_string_is_one_stop_and_none_arguments_mean_the_defaults(scripted_llm):
    llm, _ = scripted_llm("In the sea there are fish.", "In the sea there are fish.")
    assert llm.invoke("Tell me.", stop="sea").content == "In the "  # the text before it, as OpenAI returns it
    reply = llm.invoke("Again.", max_tokens=None, temperature=None, top_p=None, stop=None)
    assert reply.content == "In the sea there are fish."


def test_generate_reports_token_usage_and_finish_reasons_as_chatopenai_does(scripted_llm):
    """Callback handlers read ``llm_output["token_usage"]`` and ``generation_info``; code
    written for ChatOpenAI passes ``stream_usage`` (ChatCLM's last chunk always has usage)."""
    llm, _ = scripted_llm("One.", "Two.")
    result = llm.generate([[HumanMessage("First chat.")], [HumanMessage("Second chat.")]], stream_usage=True)
    replies = [generations[0] for generations in result.generations]
    assert [g.generation_info["finish_reason"] for g in replies] == ["stop", "stop"]
    usage = [g.message.usage_metadata for g in replies]
    assert result.llm_output["token_usage"] == {
        "prompt_tokens": sum(u["input_tokens"] for u in usage),
        "completion_tokens": sum(u["output_tokens"] for u in usage),
        "total_tokens": sum(u["total_tokens"] for u in usage),
    }
    assert result.llm_output["model_name"] == llm.model_name


@pytest.mark.parametrize("stop", [[""], ["", "zzz"], [None]])
def test_an_empty_or_non_string_stop_is_refused_not_a_one_token_reply(scripted_llm, engine, stop):
    """ "" is in every text: as a stop string it would end each reply at its first token."""
    from clm_middleware.conversation import Conversation
    from clm_middleware.errors import ConfigError

    llm, _ = scripted_llm("In the sea there are fish.")
    with pytest.raises(ConfigError, match="stop: each stop string must be a non-empty string"):
        llm.invoke("Tell me.", stop=stop)
    with pytest.raises(ConfigError, match="stop: each stop string"):
        Conversation(engine, stop=stop, tagging="rules")
    assert llm.invoke("Tell me.").content == "In the sea there are fish."  # the refused call left nothing


def test_a_setting_of_the_wrong_type_is_named_before_a_model_loads(engine, monkeypatch):
    from clm_middleware.conversation import Conversation
    from clm_middleware.engine import Engine
    from clm_middleware.errors import ConfigError
    from clm_middleware.lifecycle.config import GenerationSettings

    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: pytest.fail("a model loaded first"))
    with pytest.raises(ConfigError, match="budget: must be an integer, got str '256'"):
        Conversation(budget="256")
    with pytest.raises(ConfigError, match="max_new_tokens: must be an integer, got float"):
        GenerationSettings(max_new_tokens=1.5)
    for blank in ("", "   "):  # an id names the conversation in a store, a report, a URL
        with pytest.raises(ConfigError, match="conversation_id: must be a non-blank string"):
            Conversation(conversation_id=blank)
    for size in (0, -5):  # one bound, whichever check sees it first
        with pytest.raises(ConfigError, match=f"compress_min_tokens: must be ≥ 1, got {size}"):
            Conversation(compress_min_tokens=size)
    assert GenerationSettings(stop="sea").stop == ("sea",)
    assert Conversation(engine, stop="sea", tagging="rules").generation.stop == ("sea",)


def test_a_bad_per_call_max_tokens_is_named_as_chatclm_spells_it(scripted_llm):
    llm, _ = scripted_llm("Fine.")
    with pytest.raises(ValueError, match="max_tokens: ") as caught:
        llm.invoke("hi", max_tokens=0)
    assert "max_new_tokens" not in str(caught.value)


def test_tokens_are_counted_with_the_models_own_tokenizer_and_chat_template(scripted_llm, tiny_tok):
    """``trim_messages(token_counter=llm)`` counts what the model would be shown for the
    whole history, its opening of the reply included; LangChain's default counter is
    GPT-2's tokenizer."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages

    llm, _ = scripted_llm("Fine.")
    assert llm.get_token_ids("Lisbon in May") == tiny_tok.encode("Lisbon in May", add_special_tokens=False)
    history = [SystemMessage("Be brief."), HumanMessage("Hi."), AIMessage("Hello."), HumanMessage("Bye.")]
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    plain = [{"role": roles[m.type], "content": m.content} for m in history]
    expected = len(tiny_tok.apply_chat_template(plain, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert llm.get_num_tokens_from_messages(history) == expected
    # what a reply's usage says of the same history sent whole (it counted 4 fewer: a sweep)
    assert llm.invoke(history).usage_metadata["input_tokens"] == expected
    kept = trim_messages(history, max_tokens=expected - 1, token_counter=llm, strategy="last", include_system=True)
    assert kept[0] == history[0] and len(kept) < len(history)


def test_a_pickled_chatclm_keeps_its_settings_and_starts_without_conversations():
    import pickle

    original = ChatCLM(budget=512, stop=["END"], max_tokens=7, tagging="signals")
    restored = pickle.loads(pickle.dumps(original))
    assert (restored.budget, restored.stop, restored.max_tokens, restored.tagging) == (512, ["END"], 7, "signals")
    assert restored.conversation("anything") is None


def test_a_deep_copy_shares_the_engine_and_keeps_conversations_of_its_own(scripted_llm):
    import copy

    llm, _ = scripted_llm("hello back", "hi again")
    first = llm.invoke("hello")
    twin = copy.deepcopy(llm)
    assert twin.engine is llm.engine and twin.max_tokens == llm.max_tokens
    assert twin.conversation(first.response_metadata["conversation_id"]) is None
    assert twin.invoke("hello").content == "hi again"  # usable: its own sessions and lock


def test_pickling_a_chatclm_built_around_an_engine_object_says_how_to_pickle_one(scripted_llm):
    import pickle

    llm, _ = scripted_llm("x")
    with pytest.raises(TypeError, match="build it from its settings"):
        pickle.dumps(llm)


def test_first_calls_at_the_same_time_share_one_engine():
    """batch / asyncio.gather as a fresh ChatCLM's first use: each call built its own engine
    (weights loaded twice, pools apart) and, for a real model, the loads broke each other."""
    chat = ChatCLM(model="tiny", max_tokens=4, block_size=48)  # a setting no other test builds
    replies = chat.batch(["hi", "hello", "hey"], config={"max_concurrency": 3})
    engines = {id(chat.conversation(r.response_metadata["conversation_id"]).engine) for r in replies}
    assert len(engines) == 1


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": "x"}, "top_p"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"frequency_penalty": [1]}, "frequency_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"stop": 5}, "stop"),
    ],
)
def test_a_per_call_setting_of_the_wrong_type_is_an_error_naming_it(scripted_llm, arguments, field):
    """They were a bare ValueError / TypeError from float() or list()."""
    from clm_middleware.errors import ConfigError

    llm, _ = scripted_llm("Fine.")
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        llm.invoke("hi", **arguments)


@pytest.mark.parametrize("choice", [5, 1.5, {"type": "function"}, {"function": "get_weather"}])
def test_a_tool_choice_that_names_no_tool_and_no_mode_is_an_error(choice):
    """tool_choice=5 and {"type": "function"} without a name made a call required."""
    from clm_middleware.errors import ConfigError

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    with pytest.raises(ConfigError, match=r"^tool_choice: "):
        ChatCLM(model="tiny", max_tokens=4).bind_tools([get_weather], tool_choice=choice)


def test_the_api_key_stays_out_of_repr_and_dumps(scripted_llm):
    from langchain_core.load import dumps

    llm, _ = scripted_llm("Fine.", api_key="sk-SECRET123")
    assert "SECRET" not in repr(llm) and "SECRET" not in str(llm) and "SECRET" not in dumps(llm)


def test_a_copy_runs_its_own_settings_in_sessions_of_its_own(scripted_llm):
    """A copy shared the original's sessions, whose conversations carry the original's
    budget and tenant: model_copy(update={"budget": ...}) was ignored (a sweep)."""
    import copy

    llm, _ = scripted_llm("Fine.", "Fine too.")
    llm.invoke("Hello")
    clone = llm.model_copy(update={"budget": 512})
    reply = clone.invoke("Hello")
    held = clone.conversation(reply.response_metadata["conversation_id"])
    assert held is not None and held.config.budget == 512
    assert llm.conversation(reply.response_metadata["conversation_id"]) is None
    assert copy.copy(llm)._routers is not llm._routers


def test_settings_that_change_a_reply_key_langchains_cache():
    from clm_middleware.adapters import ChatCLM

    params = [ChatCLM(**s)._identifying_params for s in ({"seed": 1}, {"seed": 2}, {"tenant": "a"}, {"tenant": "b"})]
    assert params[0] != params[1] and params[2] != params[3]
