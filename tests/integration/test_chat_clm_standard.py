"""langchain-tests' standard integration suite for ChatCLM on the real SmolLM2-135M-Instruct.

Capabilities are declared as they are (tool calling, tool choice, structured output,
JSON mode, usage metadata). Where a 135M model genuinely cannot pass a test, the test
is marked xfail with the reason, as langchain-ollama does for its small models.
"""

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from clm_middleware.adapters import ChatCLM

SMALL_MODEL = "SmolLM2-135M-Instruct is too small to {}"
# The grammar makes every reply valid JSON; what is left is the model. Greedy, with the
# pydantic Joke's schema (titles and descriptions) in its prompt, it loops inside the
# first value ("The cat was a cat, and the cat was a cat, ...") until max_tokens, so
# the document is unfinished (finish_reason "length") and "punchline" never comes.
LOOPS_IN_A_STRING = SMALL_MODEL.format(
    "finish a pydantic Joke within 48 tokens: it loops inside the 'setup' string and never writes 'punchline'"
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
        # the grammar-constrained path (clm_middleware/structured/): valid JSON by construction
        return {"method": "json_schema"}

    # ------------------------------------------------------------------
    # Genuine limits of a 135M model. The machinery is exercised deterministically in
    # tests/unit/adapters (scripted token-level replies through the real adapter).

    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model, schema_type, request) -> None:
        if schema_type == "pydantic":
            request.applymarker(pytest.mark.xfail(reason=LOOPS_IN_A_STRING))
        super().test_structured_output(model, schema_type)

    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model, schema_type, request) -> None:
        if schema_type == "pydantic":
            request.applymarker(pytest.mark.xfail(reason=LOOPS_IN_A_STRING))
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=LOOPS_IN_A_STRING)
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=LOOPS_IN_A_STRING)
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @pytest.mark.xfail(reason=SMALL_MODEL.format("decide on its own to call a tool (tool_choice='auto')"))
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=SMALL_MODEL.format("fill every required argument (it omits customer_name)"))
    def test_unicode_tool_call_integration(self, model, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice, force_tool_call)
