"""ChatCLM fails at construction, naming the argument, for what it cannot honour."""

import pytest
from pydantic import ValidationError

from clm_middleware.adapters import ChatCLM
from clm_middleware.errors import ModelNotFoundError


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_ctx": 2048}, "num_ctx: ChatCLM has no such argument.*'budget'"),
        ({"base_url": "http://127.0.0.1:8000"}, "base_url: .*clm serve"),
        ({"temprature": 0.5}, "did you mean 'temperature'"),
        ({"budget": 0}, "budget: must be ≥ 64"),
        ({"tagging": "magic"}, "tagging: unknown mode"),
        ({"top_p": 0}, "top_p"),
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"seed": 2**70}, "seed: must be an integer in"),
    ],
)
def test_an_unknown_argument_or_a_bad_setting_fails_at_construction(arguments, message):
    with pytest.raises(ValidationError, match=message):
        ChatCLM(model="tiny", **arguments)


def test_a_model_path_that_is_not_there_fails_at_construction(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        ChatCLM(model=str(tmp_path / "missing.gguf"))
