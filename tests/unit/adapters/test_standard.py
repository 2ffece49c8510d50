"""langchain-tests' standard unit suite for ChatCLM (construction, params, serialization)."""

from langchain_tests.unit_tests import ChatModelUnitTests

from clm_middleware.adapters import ChatCLM


class TestChatCLMUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatCLM]:
        return ChatCLM

    @property
    def chat_model_params(self) -> dict:
        return {"model": "tiny"}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return True
