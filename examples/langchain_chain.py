"""prompt | model | parser, with the chat history kept by the caller: a chat that remembers, over ChatCLM.

    python examples/langchain_chain.py

The history is a plain list of messages re-sent on every call (what LangGraph's message
state or any agent loop does; no deprecated RunnableWithMessageHistory). ChatCLM maps the
growing history onto one managed conversation, so each call prefills only the new turn.
"""

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder

from clm_middleware.adapters import ChatCLM

# tagging "auto" (the default) calibrates the model once: SmolLM2-135M cannot follow the
# [LIFECYCLE] protocol, so it is labelled from its own signals (self-information, attention)
llm = ChatCLM(max_tokens=48, budget=1024)
prompt = ChatPromptTemplate.from_messages(
    [("system", "You are a concise assistant."), MessagesPlaceholder("history"), ("human", "{question}")]
)
chain = prompt | llm | StrOutputParser()
history: list[BaseMessage] = []
questions = (
    "My name is Ana and my order number is 48213-KX.",
    "What is the capital of France?",
    "What was my order number?",
)
for question in questions:
    answer = chain.invoke({"history": history, "question": question})
    history += [HumanMessage(question), AIMessage(answer)]
    print(f"> {question}\n{answer}\n")
messages = prompt.invoke({"history": history, "question": "One more question: what is 2 + 2?"})
reply = llm.invoke(messages)  # the same history once more, one new question
usage = reply.usage_metadata
print(f"prompt tokens read from the cache: {usage['input_token_details']['cache_read']} of {usage['input_tokens']}")
