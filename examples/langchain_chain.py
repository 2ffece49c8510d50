"""prompt | model | parser, with message history: a chat that remembers, over ChatCLM.

    python examples/langchain_chain.py

RunnableWithMessageHistory re-sends the growing history on every call; ChatCLM maps it
onto one managed conversation, so each call prefills only the new turn.
"""

from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables.history import RunnableWithMessageHistory

from clm_middleware.adapters import ChatCLM

# SmolLM2-135M cannot follow the [LIFECYCLE] protocol in words; "auto" (the default) finds
# that out over five turns, "signals" starts there (labels from the model's own computation).
llm = ChatCLM(max_tokens=48, budget=1024, tagging="signals")
prompt = ChatPromptTemplate.from_messages(
    [("system", "You are a concise assistant."), MessagesPlaceholder("history"), ("human", "{question}")]
)
histories: dict[str, InMemoryChatMessageHistory] = {}
chat = RunnableWithMessageHistory(
    prompt | llm | StrOutputParser(),
    lambda session_id: histories.setdefault(session_id, InMemoryChatMessageHistory()),
    input_messages_key="question",
    history_messages_key="history",
)
config = {"configurable": {"session_id": "demo"}}
questions = (
    "My name is Ana and my order number is 48213-KX.",
    "What is the capital of France?",
    "What was my order number?",
)
for question in questions:
    print(f"> {question}\n{chat.invoke({'question': question}, config=config)}\n")
stats = llm.invoke([("human", "One more question: what is 2 + 2?")]).response_metadata["pool"]
print("pool blocks holding K/V:", stats["blocks_in_use"] + stats["blocks_cached_free"])
