"""langchain-tests' standard integration suite for ChatCLM on the real SmolLM2-135M-Instruct.

Capabilities are declared as they are (tool calling, tool choice, structured output,
JSON mode, usage metadata). Where a 135M model genuinely cannot pass a test, the test
is marked xfail with the reason, as langchain-ollama does for its small models.
"""

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from clm_middleware.adapters import ChatCLM

SMALL_MODEL = "SmolLM2-135M-Instruct is too small to {}"
# json_mode's grammar is any JSON object: the keys are the model's to choose. SmolLM2
# loops inside "setup" (the loop is closed: "string_loop_closed"), then ends the object
# without the "punchline" key the prompt asks for. With the schema (json_schema) the
# grammar writes the key and the same tests pass.
JSON_MODE_KEYS = SMALL_MODEL.format(
    "write both keys a json_mode prompt asks for: it closes the object after 'setup' (no 'punchline')"
)


class TestChatCLMIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatCLM]:
        return ChatCLM

    @property
    def chat_model_params(self) -> dict:
        # short replies keep the suite inside CI's time budget on 2 CPU cores
        return {"max_tokens": 48, "tagging": "signals"}

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

    @property
    def structured_output_kwargs(self) -> dict:
        # LangChain's default method, function calling: the required call is decoded under a
        # grammar of the schema (clm_middleware/structured/), valid by construction. With
        # json_schema the same grammar holds, but SmolLM2 fills "setup" with a clause loop
        # ("The cat was a cat, and ...", closed at its repeat) and 48 tokens end inside
        # "punchline": a reply cut by max_tokens fails to parse, as the openai SDK's parse()
        # raises, rather than passing a truncated value (tests/unit/adapters covers it).
        return {}

    # ------------------------------------------------------------------
    # Genuine limits of a 135M model. The machinery is exercised deterministically in
    # tests/unit/adapters (scripted token-level replies through the real adapter).

    @pytest.mark.xfail(reason=JSON_MODE_KEYS)
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @pytest.mark.xfail(reason=SMALL_MODEL.format("decide on its own to call a tool (tool_choice='auto')"))
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=SMALL_MODEL.format("fill every required argument (it omits customer_name)"))
    def test_unicode_tool_call_integration(self, model, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice, force_tool_call)
