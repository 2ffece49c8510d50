import pytest

from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.models import ScriptedReplies


@pytest.fixture
def converse(engine):
    """A conversation on the tiny model; protocol modes get a short protocol prompt (byte tokens are many)."""

    def make(**kwargs) -> Conversation:
        kwargs.setdefault("max_new_tokens", 8)
        kwargs.setdefault("tagging", "signals")
        kwargs.setdefault("protocol_prompt", "Label segments in a [LIFECYCLE] block.")
        return Conversation(kwargs.pop("engine", engine), **kwargs)

    return make


@pytest.fixture
def scripted(tiny_model, tiny_tok):
    """An engine whose replies follow a script of texts (each ends with EOS)."""

    def make(*texts: str) -> tuple[Engine, ScriptedReplies]:
        script = ScriptedReplies([*tiny_tok.encode(t, add_special_tokens=False), tiny_tok.eos_token_id] for t in texts)
        return Engine(tiny_model, tiny_tok, logits_processors=[script]), script

    return make
