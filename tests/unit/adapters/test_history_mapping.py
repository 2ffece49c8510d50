"""LangChain re-sends whole histories: they extend, fork or name a managed conversation."""

import contextlib

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage

from clm_middleware.lifecycle.tagging import TaggingConfig


def conversation_of(message) -> str:
    return message.response_metadata["conversation_id"]


def test_extending_histories_reuse_one_conversation_and_its_cache(scripted_llm):
    llm, _ = scripted_llm("A1.", "A2.", "A3.")
    h1, h2, h3 = HumanMessage("First question here."), HumanMessage("Second one."), HumanMessage("Third one.")
    a1 = llm.invoke([h1])
    a2 = llm.invoke([h1, a1, h2])
    a3 = llm.invoke([h1, a1, h2, a2, h3])
    assert conversation_of(a1) == conversation_of(a2) == conversation_of(a3)
    assert a3.usage_metadata["input_token_details"]["cache_read"] >= a2.usage_metadata["input_tokens"] - 16


def test_editing_the_third_message_forks_from_the_common_prefix(scripted_llm):
    llm, _ = scripted_llm("A1.", "A2.", "A2 edited.")
    h1 = HumanMessage("First question here.")
    a1 = llm.invoke([h1])
    a2 = llm.invoke([h1, a1, HumanMessage("Second one.")])
    edited = llm.invoke([h1, a1, HumanMessage("Second one, edited.")])
    assert conversation_of(edited) != conversation_of(a2)
    assert edited.content == "A2 edited."
    prefix_tokens = a1.usage_metadata["input_tokens"]  # the shared prefix was computed before
    assert edited.usage_metadata["input_token_details"]["cache_read"] >= prefix_tokens - 16
    router = next(iter(llm._routers.values()))
    assert len(router) == 2  # the original branch is still there, untouched


def test_a_client_that_edits_every_reply_forks_each_call_under_ids_of_one_length(scripted_llm):
    """Sending back its own wording of each reply (an agent that reformats them) forks at
    every call; the branch ids name the first conversation and a suffix, never a chain."""
    from langchain_core.messages import AIMessage

    llm, _ = scripted_llm(*[f"Reply {n}." for n in range(4)])
    history = [HumanMessage("Question 0.")]
    ids = []
    for n in range(4):
        reply = llm.invoke(history)
        ids.append(conversation_of(reply))
        history += [AIMessage(f"Edited reply {n}."), HumanMessage(f"Question {n + 1}.")]
    root = ids[0]
    assert len(set(ids)) == 4 and all(i.startswith(f"{root}~") and len(i) == len(root) + 9 for i in ids[1:])


def test_retrying_the_last_answer_branches_and_keeps_the_first_answer(scripted_llm):
    llm, _ = scripted_llm("A1.", "A2.", "A2 again.")
    h1, h2 = HumanMessage("First question here."), HumanMessage("Second one.")
    a1 = llm.invoke([h1])
    a2 = llm.invoke([h1, a1, h2])
    retry = llm.invoke([h1, a1, h2])
    assert retry.content == "A2 again." and conversation_of(retry) != conversation_of(a2)
    # all cached but the attention window, the prompt's last 32 tokens, whose queries are observed again
    window = TaggingConfig().attention_window
    assert retry.usage_metadata["input_token_details"]["cache_read"] >= a2.usage_metadata["input_tokens"] - window
    follow_up = llm.invoke([h1, a1, h2, a2, HumanMessage("Back on the first branch.")])
    assert conversation_of(follow_up) == conversation_of(a2)


def test_two_branches_a_history_continues_alike_extend_the_one_answered_last(scripted_llm):
    """The same question asked twice forks; the second answer's history (the same text as
    the first's) then extends the branch that gave it, the one the caller holds the id of."""
    llm, _ = scripted_llm("A1.", "A1.", "A2.")
    h1 = HumanMessage("First question here.")
    first = llm.invoke([h1])
    second = llm.invoke([h1])
    assert conversation_of(second) != conversation_of(first)
    follow_up = llm.invoke([h1, second, HumanMessage("Second one.")])
    assert conversation_of(follow_up) == conversation_of(second)


def test_a_named_session_follows_its_latest_branch(scripted_llm):
    llm, _ = scripted_llm("A1.", "B1.", "A2.")
    config = {"configurable": {"session_id": "user-42"}}
    a1 = llm.invoke([HumanMessage("Hello there.")], config=config)
    assert conversation_of(a1) == "user-42"
    b1 = llm.invoke([HumanMessage("Different opening.")], config=config)
    assert conversation_of(b1) != "user-42"  # diverged at message 0: a new branch under the name
    a2 = llm.invoke([HumanMessage("Different opening."), b1, HumanMessage("And then?")], config=config)
    assert conversation_of(a2) == conversation_of(b1)


def test_a_blank_session_id_names_nothing_and_the_history_routes_the_call(scripted_llm):
    llm, _ = scripted_llm("A1.", "A2.")
    a1 = llm.invoke([HumanMessage("Hello there.")], config={"configurable": {"session_id": "   "}})
    assert conversation_of(a1).strip()  # a fresh id, not the blank name
    a2 = llm.invoke([HumanMessage("Hello there."), a1, HumanMessage("And?")], session_id="")
    assert conversation_of(a2) == conversation_of(a1)  # extended, as an unnamed call is


def test_a_named_session_goes_back_to_an_earlier_branch_it_matches(scripted_llm):
    """A chat UI regenerates an answer, then the user goes back to the first one: the
    history matches the first branch exactly, which is extended (no fork of a fork)."""
    llm, _ = scripted_llm("A1.", "A2.", "A2 again.", "A3.", "B3.")
    config = {"configurable": {"session_id": "ui"}}
    h1, h2 = HumanMessage("First question here."), HumanMessage("Second one.")
    a1 = llm.invoke([h1], config=config)
    a2 = llm.invoke([h1, a1, h2], config=config)
    retry = llm.invoke([h1, a1, h2], config=config)
    assert conversation_of(retry) != conversation_of(a2)  # the retry is a branch
    back = llm.invoke([h1, a1, h2, a2, HumanMessage("Back on the first branch.")], config=config)
    assert conversation_of(back) == conversation_of(a2) == "ui"
    other = llm.invoke([h1, a1, h2, retry, HumanMessage("And on the second.")], config=config)
    assert conversation_of(other) == conversation_of(retry)
    assert llm.conversation("ui").id == conversation_of(retry)  # the name follows the latest branch


def test_concurrent_calls_on_the_same_history_fork_instead_of_interleaving(scripted_llm):
    llm, _ = scripted_llm("A1.", "X.", "Y.")
    h1 = HumanMessage("First question here.")
    a1 = llm.invoke([h1])
    results = llm.batch([[h1, a1, HumanMessage("left")], [h1, a1, HumanMessage("right")]])
    assert sorted(r.content for r in results) == ["X.", "Y."]
    assert len({conversation_of(r) for r in results}) == 2


def test_a_failed_call_leaves_the_conversation_as_it_was_so_a_retry_extends_it(scripted_llm):
    from clm_middleware.lifecycle.compaction import ContextBudgetError

    llm, _ = scripted_llm("A1.", "A2.", budget=200)
    h1 = HumanMessage("First question here.")
    a1 = llm.invoke([h1])
    with pytest.raises(ContextBudgetError):
        llm.invoke([h1, a1, HumanMessage("word " * 400)])
    retry = llm.invoke([h1, a1, HumanMessage("A short one.")])
    assert retry.content == "A2." and conversation_of(retry) == conversation_of(a1)  # extended, not forked
    router = next(iter(llm._routers.values()))
    (session,) = router.sessions()
    assert [m.content for m in session.conversation.history] == ["First question here.", "A1.", "A short one.", "A2."]


def test_a_named_session_already_in_the_store_starts_a_suffixed_conversation_and_keeps_the_stored_one(
    scripted_llm, tmp_path
):
    from clm_middleware.conversation import Conversation

    path = str(tmp_path / "sessions.db")
    history = [HumanMessage("My order is 48213-KX.")]
    earlier, _ = scripted_llm("Noted.", store_path=path)  # an earlier process
    first = earlier.invoke(history, session_id="s1")
    assert conversation_of(first) == "s1"
    stored = [m.content for m in Conversation.load(path, "s1", earlier.engine).history]

    later, _ = scripted_llm("Noted again.", store_path=path)  # a fresh process: its router knows nothing
    again = later.invoke(history, session_id="s1")
    assert again.content == "Noted again."
    assert conversation_of(again).startswith("s1~")
    assert [m.content for m in Conversation.load(path, "s1", later.engine).history] == stored


def test_a_failed_call_leaves_every_conversation_and_name_as_it_was(scripted_llm, tmp_path):
    from langchain_core.messages import AIMessage, ToolMessage

    from clm_middleware.conversation import Conversation
    from clm_middleware.errors import ClmError
    from clm_middleware.store import Store

    path = str(tmp_path / "s.db")
    llm, _ = scripted_llm("Noted.", "Still here.", budget=256, store_path=path)
    first = [HumanMessage("My order is 48213-KX.")]
    reply = llm.invoke(first, session_id="s1")
    too_long = HumanMessage("word " * 600)
    call = AIMessage("", tool_calls=[{"name": "lookup", "args": {"id": "48213-KX"}, "id": "c1"}])
    own_messages = [HumanMessage("Look it up."), call, ToolMessage("shipped", tool_call_id="c1")]
    failing = [
        [*first, reply, *own_messages, too_long],  # extends s1 with the caller's assistant and tool messages
        [HumanMessage("My order is 99999-ZZ."), reply, too_long],  # forks s1 at an edited message
    ]
    for history in failing:
        with pytest.raises(ClmError, match="budget"):
            llm.invoke(history, session_id="s1")
        conversation = llm.conversation("s1")
        assert conversation is not None and conversation.id == "s1"
        assert [m.content for m in conversation.history] == ["My order is 48213-KX.", "Noted."]
    assert Store(path).conversation_ids() == ["s1"]  # no empty row of the failed fork
    retry = llm.invoke([*first, reply, HumanMessage("Thanks.")], session_id="s1")
    assert retry.response_metadata["conversation_id"] == "s1" and retry.content == "Still here."
    assert retry.usage_metadata["input_token_details"]["cache_read"] > 0
    assert [m.content for m in Conversation.load(path, "s1", llm.engine).history][-1] == "Still here."


def test_chat_messages_with_a_known_role_read_as_that_role_and_others_are_refused(scripted_llm):
    from langchain_core.messages import ChatMessage, SystemMessage

    from clm_middleware.errors import ConfigError

    llm, _ = scripted_llm("A1.", "A2.")
    typed = llm.invoke([SystemMessage("Be brief."), HumanMessage("Hello there.")])
    loose = llm.invoke(
        [ChatMessage(role="system", content="Be brief."), ChatMessage(role="User", content="Hello there.")]
    )
    assert loose.usage_metadata["input_tokens"] == typed.usage_metadata["input_tokens"]  # the same prompt
    assert loose.usage_metadata["input_token_details"]["cache_read"] > 0  # served from the first call's blocks
    with pytest.raises(ConfigError, match="ChatMessage role 'narrator'"):
        llm.invoke([ChatMessage(role="narrator", content="Once upon a time.")])


def test_a_cancelled_ainvoke_stops_its_turn_and_the_next_call_extends_the_chat(tiny_model, tiny_tok):
    import asyncio
    import threading

    from clm_middleware.adapters import ChatCLM
    from clm_middleware.engine import Engine
    from clm_middleware.models import ScriptedReplies

    replies = ["A1.", "word " * 50, "A2."]
    script = ScriptedReplies([*tiny_tok.encode(r, add_special_tokens=False), tiny_tok.eos_token_id] for r in replies)
    decoding, release = threading.Event(), threading.Event()

    def gate(generated, logits):  # holds the second turn at its second token until released
        if len(generated) == 1 and script.started > 1:
            decoding.set()
            release.wait(timeout=30)
        return logits

    engine = Engine(tiny_model, tiny_tok, logits_processors=[script, gate])
    llm = ChatCLM(engine=engine, tagging="signals", max_tokens=64)
    h1, h2 = HumanMessage("First question here."), HumanMessage("Second one.")
    a1 = llm.invoke([h1])

    async def cancel_mid_turn() -> None:
        task = asyncio.create_task(llm.ainvoke([h1, a1, h2]))
        assert await asyncio.to_thread(decoding.wait, 30)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancel_mid_turn(), timeout=60))
    assert len(llm.conversation(conversation_of(a1)).history) == 2  # nothing of the cancelled turn stays
    again = llm.invoke([h1, a1, h2])
    assert conversation_of(again) == conversation_of(a1)  # extended, not forked


def test_an_async_stream_closed_early_is_undone_before_the_next_call_which_extends_the_chat(tiny_model, tiny_tok):
    """aclose() left the turn running until the inner stream was collected: the next call
    found the conversation busy and forked (a sweep)."""
    import asyncio

    from clm_middleware.adapters import ChatCLM
    from clm_middleware.engine import Engine
    from clm_middleware.models import ScriptedReplies

    replies = ["A1.", "word " * 60, "A2."]
    script = ScriptedReplies([*tiny_tok.encode(r, add_special_tokens=False), tiny_tok.eos_token_id] for r in replies)
    llm = ChatCLM(engine=Engine(tiny_model, tiny_tok, logits_processors=[script]), tagging="signals", max_tokens=80)
    h1, h2 = HumanMessage("First question here."), HumanMessage("Second one.")
    a1 = llm.invoke([h1])

    async def close_early_then_ask_again():
        stream = llm.astream([h1, a1, h2])
        await anext(stream)
        await stream.aclose()
        return await llm.ainvoke([h1, a1, h2])

    again = asyncio.run(asyncio.wait_for(close_early_then_ask_again(), timeout=60))
    assert conversation_of(again) == conversation_of(a1)  # extended, not forked


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_the_same_history_sent_again_right_after_a_stopped_async_stream_extends_the_chat(scripted_llm, how):
    """The stopped turn is undone by a task of its own, after the next call had started:
    that call found the conversation busy and forked a branch per stop (a helper's probe)."""
    import asyncio

    llm, _ = scripted_llm("A1.", "word " * 60, "A2.", max_tokens=80)
    h1, h2 = HumanMessage("First question here."), HumanMessage("Second one.")
    a1 = llm.invoke([h1])

    async def stop_then_ask_again():
        if how == "break":
            async for _ in llm.astream([h1, a1, h2]):
                break
        else:
            streaming = asyncio.Event()

            async def consume():
                async for _ in llm.astream([h1, a1, h2]):
                    streaming.set()
                    await asyncio.sleep(0.05)  # 60 words: the stream is far from its end

            task = asyncio.create_task(consume())
            await streaming.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return await llm.ainvoke([h1, a1, h2])

    again = asyncio.run(asyncio.wait_for(stop_then_ask_again(), timeout=60))
    assert again.content == "A2." and conversation_of(again) == conversation_of(a1)  # extended, not forked
    assert len(llm.conversation(conversation_of(a1)).history) == 4


def test_a_call_after_breaking_out_of_an_async_stream_is_not_taken_for_one_of_its_turns(scripted_llm):
    """``async for chunk in llm.astream(...): break`` left the stream's turn list set in the
    caller's task: the next ainvoke (on any ChatCLM) joined it and was cancelled when the
    abandoned stream was collected, TurnCancelled (a helper's probe)."""
    import asyncio

    from clm_middleware.adapters import ChatCLM

    llm, _ = scripted_llm("word " * 60, "Paris.", "Rome.", max_tokens=80)
    engine = llm.engine

    async def break_then_ask():
        async for _ in llm.astream([HumanMessage("Write a haiku about the sea.")]):
            break
        same = await llm.ainvoke([HumanMessage("What is the capital of France?")])
        other = await ChatCLM(engine=engine, tagging="signals", max_tokens=80).ainvoke([HumanMessage("And Italy?")])
        return same, other

    same, other = asyncio.run(asyncio.wait_for(break_then_ask(), timeout=60))
    assert (same.content, other.content) == ("Paris.", "Rome.")


def test_a_call_a_callback_starts_during_an_async_stream_is_not_one_of_the_streams_turns(scripted_llm):
    """A task started from on_llm_new_token (a chat title made on the first token) copies
    the stream's context: its call joined the stream's turns and was cancelled when the
    stream ended, TurnCancelled (a helper's probe)."""
    import asyncio

    from langchain_core.callbacks import AsyncCallbackHandler

    (main, _), (titles, _) = scripted_llm("Short."), scripted_llm("A title " * 12)
    started: list[asyncio.Task] = []

    class Title(AsyncCallbackHandler):
        async def on_llm_new_token(self, token: str, **kwargs) -> None:
            if not started:
                started.append(asyncio.create_task(titles.ainvoke([HumanMessage("Name this chat.")])))

    async def stream_then_title():
        chunks = [c.content async for c in main.astream([HumanMessage("Hi.")], config={"callbacks": [Title()]})]
        return "".join(chunks), await started[0]

    text, title = asyncio.run(asyncio.wait_for(stream_then_title(), timeout=60))
    assert text == "Short." and title.content.startswith("A title")


def test_get_token_ids_counts_special_token_text_as_the_prompt_holds_it(scripted_llm, tiny_tok):
    llm, _ = scripted_llm("Hi.")
    text = f"say {tiny_tok.eos_token} please"
    assert tiny_tok.eos_token_id not in llm.get_token_ids(text)
    assert llm.get_num_tokens(text) == len(llm.get_token_ids(text))


@pytest.mark.parametrize("where", ["constructor", "call"])
def test_stream_usage_false_leaves_usage_off_the_stream_and_invoke_keeps_it(scripted_llm, where):
    """ChatOpenAI's and ChatAnthropic's field: ChatCLM(stream_usage=True) had been refused,
    and stream(..., stream_usage=False) still put usage on the last chunk (a helper's probe)."""
    import asyncio

    llm, _ = scripted_llm(*["Hi there."] * 3, **({"stream_usage": False} if where == "constructor" else {}))
    call = {"stream_usage": False} if where == "call" else {}
    streamed = [chunk.usage_metadata for chunk in llm.stream("hello", **call)]
    assert streamed and not any(streamed)

    async def collect():
        return [chunk.usage_metadata async for chunk in llm.astream([HumanMessage("hello")], **call)]

    assert not any(asyncio.run(asyncio.wait_for(collect(), timeout=60)))
    assert llm.invoke("hello", **call).usage_metadata["output_tokens"] > 0
    assert type(llm)(engine=llm.engine).stream_usage is True


class _TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


@pytest.mark.parametrize("streaming", [None, True, False], ids=["unset", "true", "false"])
def test_invoke_reports_tokens_to_callbacks_only_when_streaming_is_asked(scripted_llm, streaming):
    """As LangChain's chat models: an invoke had fired on_llm_new_token for every token,
    so a handler printing tokens printed an invoke's reply as if streamed."""
    settings = {} if streaming is None else {"streaming": streaming}
    llm, _ = scripted_llm("Hi there, friend.", "Hi there, friend.", **settings)
    counter = _TokenCounter()
    reply = llm.invoke("hello", config={"callbacks": [counter]})
    assert reply.content == "Hi there, friend."
    assert "".join(counter.tokens) == (reply.content if streaming else "")
    streamed = _TokenCounter()
    chunks = [str(c.content) for c in llm.stream("hello", config={"callbacks": [streamed]})]
    assert "".join(chunks) == reply.content
    if streaming is False:  # LangChain's switch: streaming off, stream() yields the reply whole
        assert chunks == [reply.content] and streamed.tokens == []
    else:
        assert len(chunks) > 1 and "".join(streamed.tokens) == reply.content
