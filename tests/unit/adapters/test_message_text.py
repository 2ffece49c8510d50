"""What the model reads of a LangChain message's content blocks (adapters/messages.py)."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from clm_middleware.adapters.messages import message_text, to_turn
from clm_middleware.errors import ConfigError


def _tool(content, **fields) -> ToolMessage:
    return ToolMessage(content=content, tool_call_id="c1", **fields)


def test_a_tool_result_of_json_blocks_reaches_the_model_as_its_json():
    text = message_text(_tool([{"type": "json", "json": {"city": "Lisbon", "temp_c": 21}}]))
    assert json.loads(text) == {"city": "Lisbon", "temp_c": 21}


def test_a_tool_result_of_plain_dicts_reaches_the_model_as_json():
    assert json.loads(message_text(_tool([{"temp": 21, "sky": "sunny"}]))) == {"temp": 21, "sky": "sunny"}


def test_a_search_result_block_reads_as_its_title_source_and_text():
    block = {
        "type": "search_result",
        "title": "Tram 28",
        "source": "https://example.org/tram",
        "content": [{"type": "text", "text": "Runs every 12 minutes."}],
    }
    assert message_text(_tool([block])) == "Tram 28\nhttps://example.org/tram\nRuns every 12 minutes."


def test_text_documents_and_custom_tool_outputs_are_read_and_media_named():
    content = [
        {"type": "document", "source": {"type": "text", "data": "Clause 4: no refunds."}, "title": "Terms"},
        {"type": "custom_tool_call_output", "output": "exit code 0"},
        {"type": "image", "url": "https://example.org/a.png"},
    ]
    assert message_text(_tool(content)) == "Terms\nClause 4: no refunds.\nexit code 0\n[image omitted]"


def test_responses_api_text_anthropic_tool_results_refusals_and_wrapped_blocks_are_read_as_text():
    """They reached the model as "[input_text omitted]": the user's question was lost."""
    assert message_text(HumanMessage(content=[{"type": "input_text", "text": "What is 2+2?"}])) == "What is 2+2?"
    assert message_text(AIMessage(content=[{"type": "output_text", "text": "4."}])) == "4."
    assert message_text(AIMessage(content=[{"type": "refusal", "refusal": "I can't help with that."}])) == (
        "I can't help with that."
    )
    nested = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "21 C, sunny"}]}
    assert message_text(_tool([nested])) == "21 C, sunny"
    assert message_text(_tool([{"type": "tool_result", "tool_use_id": "t1", "content": "done"}])) == "done"
    wrapped = {"type": "non_standard", "value": {"type": "text", "text": "from a provider"}}
    assert message_text(HumanMessage(content=[wrapped])) == "from a provider"


def test_reasoning_blocks_of_a_sent_back_reply_are_not_shown_to_the_model():
    reply = AIMessage(
        content=[{"type": "reasoning", "reasoning": "The user wants..."}, {"type": "text", "text": "Hi!"}]
    )
    assert message_text(reply) == "Hi!"


def test_an_error_tool_result_is_marked_once():
    assert to_turn(_tool("sunny", status="error")).text == "Error: sunny"
    # LangGraph's ToolNode already writes "Error: ..." into a failed call's message
    assert (
        to_turn(_tool("Error: ValueError('unknown city')", status="error")).text == "Error: ValueError('unknown city')"
    )


def test_text_parts_are_joined_one_per_line():
    assert message_text(HumanMessage(content=["Translate to Spanish:", {"type": "text", "text": "Good morning"}])) == (
        "Translate to Spanish:\nGood morning"
    )


def test_a_lone_surrogate_is_an_error_naming_the_message_not_an_encoding_traceback(scripted_llm):
    # a broken "\ud800" JSON escape: the CLI, the HTTP API and Conversation name it; ChatCLM
    # raised a bare UnicodeEncodeError from hashing the history
    llm, _ = scripted_llm("fine")
    messages = [HumanMessage("hello"), AIMessage("hi"), HumanMessage("broken \ud800 text")]
    with pytest.raises(ConfigError, match=r"messages\[2\]\.content: holds a lone surrogate \('\\ud800'\)"):
        llm.invoke(messages)
    assert to_turn(HumanMessage("fine text"), 0).text == "fine text"
