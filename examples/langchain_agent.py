"""An agent with two tools over ChatCLM: the model calls tools, reads results, answers.

    python examples/langchain_agent.py

SmolLM2-135M rarely decides to call a tool on its own, so the first step requires a
call (tool_choice="any": the reply opens with a tool call and the model fills it in).
Left to decide after the result, it calls the same tool again and again (four times in
four steps, never answering), so a repeated call is not run again: that step asks for
the answer instead (tool_choice="none": no tools offered), as an agent caps a loop. A
stronger model answers with tool_choice="auto" on its own. Each step re-sends the whole
history, as LangChain agents do; ChatCLM recognises it and prefills only the new messages.
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


def repeats(reply, done: list[tuple[str, dict]]) -> bool:
    """Whether every call of ``reply`` was made before with the same arguments."""
    return bool(reply.tool_calls) and all((call["name"], call["args"]) in done for call in reply.tool_calls)


llm = ChatCLM(max_tokens=48, tagging="signals")
history = [
    SystemMessage("You are a travel assistant. Use the tools to answer."),
    HumanMessage("What's the weather like in Lisbon right now?"),
]
done: list[tuple[str, dict]] = []  # (tool, arguments) already run
for step in range(4):
    model = llm.bind_tools(list(TOOLS.values()), tool_choice="any" if step == 0 else "auto")
    reply = model.invoke(history)
    if repeats(reply, done):  # the same call again: ask for the answer from the results instead
        print(f"step {step}: the model repeated {reply.tool_calls[0]['name']}; asking for the answer")
        reply = llm.bind_tools(list(TOOLS.values()), tool_choice="none").invoke(history)
    history.append(reply)
    usage = reply.usage_metadata
    cached = usage["input_token_details"]["cache_read"]
    print(f"step {step}: prompt {usage['input_tokens']} tokens, {cached} from cache")
    if not reply.tool_calls:
        print("answer:", reply.content)
        break
    for call in reply.tool_calls:
        done.append((call["name"], call["args"]))
        result = run_tool(call)
        print(f"  {call['name']}({call['args']}) -> {result.content}")
        history.append(result)
    for bad in reply.invalid_tool_calls:
        print(f"  invalid tool call: {bad['error']}")
        history.append(ToolMessage(f"Error: {bad['error']}", tool_call_id=bad["id"], status="error"))
