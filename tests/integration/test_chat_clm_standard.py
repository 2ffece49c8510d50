"""langchain-tests' standard integration suite for ChatCLM on the real SmolLM2-135M-Instruct.

Capabilities are declared as they are (tool calling, tool choice, structured output,
JSON mode, usage metadata). Where a 135M model genuinely cannot pass a test, the test
is marked xfail with the reason, as langchain-ollama does for its small models.
"""

from langchain_tests.integration_tests import ChatModelIntegrationTests

from clm_middleware.adapters import ChatCLM

SMALL_MODEL = "SmolLM2-135M-Instruct is too small to {}"


class TestChatCLMIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatCLM]:
        return ChatCLM

    @property
    def chat_model_params(self) -> dict:
        # short replies keep the suite inside CI's time budget on 2 CPU cores
        return {"max_tokens": 24, "tagging": "signals"}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        return "tiny"
