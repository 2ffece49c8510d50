"""An agent with two tools over ChatCLM: the model calls tools, reads results, answers.

    python examples/langchain_agent.py

SmolLM2-135M rarely decides to call a tool on its own, so the first step requires a
call (tool_choice="any": the reply opens with a tool call and the model fills it in);
later steps let the model decide. Each step re-sends the whole history, as LangChain
agents do; ChatCLM recognises it and prefills only the new messages.
"""

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import ValidationError

from clm_middleware.adapters import ChatCLM


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"Sunny and 21°C in {city}."


@tool
def get_time(city: str) -> str:
    """Current local time in a city."""
    return f"It is 14:05 in {city}."


TOOLS = {t.name: t for t in (get_weather, get_time)}


def run_tool(call: dict) -> ToolMessage:
    """The tool's result, or an error result the model can read and correct (as agent
    frameworks do: a bad call must not end the run)."""
    if call["name"] not in TOOLS:
        return ToolMessage(f"Error: unknown tool {call['name']!r}", tool_call_id=call["id"], status="error")
    try:
        return TOOLS[call["name"]].invoke(call)
    except ValidationError as error:
        return ToolMessage(f"Error: {error.errors()[0]['msg']}", tool_call_id=call["id"], status="error")


llm = ChatCLM(max_tokens=48, tagging="signals")
history = [
    SystemMessage("You are a travel assistant. Use the tools to answer."),
    HumanMessage("What's the weather like in Lisbon right now?"),
]
for step in range(4):
    model = llm.bind_tools(list(TOOLS.values()), tool_choice="any" if step == 0 else "auto")
    reply = model.invoke(history)
    history.append(reply)
    usage = reply.usage_metadata
    cached = usage["input_token_details"]["cache_read"]
    print(f"step {step}: prompt {usage['input_tokens']} tokens, {cached} from cache")
    if not reply.tool_calls:
        print("answer:", reply.content)
        break
    for call in reply.tool_calls:
        result = run_tool(call)
        print(f"  {call['name']}({call['args']}) -> {result.content}")
        history.append(result)
    for bad in reply.invalid_tool_calls:
        print(f"  invalid tool call: {bad['error']}")
        history.append(ToolMessage(f"Error: {bad['error']}", tool_call_id=bad["id"], status="error"))
