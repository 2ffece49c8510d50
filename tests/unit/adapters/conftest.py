import pytest

from clm_middleware.adapters import ChatCLM
from clm_middleware.engine import Engine
from clm_middleware.models import ScriptedReplies


@pytest.fixture
def scripted_llm(tiny_model, tiny_tok):
    """A ChatCLM whose replies follow a script, token by token, through the real engine."""

    def make(*replies: str, **settings) -> tuple[ChatCLM, ScriptedReplies]:
        script = ScriptedReplies(
            [*tiny_tok.encode(r, add_special_tokens=False), tiny_tok.eos_token_id] for r in replies
        )
        engine = Engine(tiny_model, tiny_tok, logits_processors=[script])
        settings.setdefault("tagging", "signals")
        settings.setdefault("max_tokens", 200)
        return ChatCLM(engine=engine, **settings), script

    return make
