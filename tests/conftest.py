"""Shared fixtures. Unit tests run on a tiny random Llama; integration tests on SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from clm_middleware.cache import PoolConfig
from clm_middleware.conversation import Conversation
from clm_middleware.engine import Engine
from clm_middleware.models import ScriptedReplies, tiny_llama, tiny_tokenizer

# the cores are shared among pytest-xdist's workers (`make test` runs two), so that two
# workers on two cores do not each run two threads
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture
def make_engine(tiny_model, tiny_tok):
    """A fresh engine (own pool) around the shared tiny model."""

    def make(block_size: int = 16, max_blocks: int | None = 256) -> Engine:
        return Engine(
            tiny_model,
            tiny_tok,
            pool_config=PoolConfig(block_size=block_size, max_blocks=max_blocks),
        )

    return make


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()


@pytest.fixture(scope="session")
def tiny_family_model():
    """A tiny random model of another Llama-family architecture ("qwen2": q/k/v biases,
    "mistral", "qwen3": per-head q/k norms), full attention, 2 layers, 4 heads over 2 K/V heads."""
    import transformers

    def make(architecture: str) -> torch.nn.Module:
        config_class, model_class = {
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        }[architecture]
        torch.manual_seed(0)
        config = config_class(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            sliding_window=None,
        )
        return model_class(config).eval()

    return make


@pytest.fixture(params=[False, True], ids=["arena", "paged"])
def make_either_engine(request, tiny_model, tiny_tok):
    """Like ``make_engine``, once with a working arena and once with ``paged_kv``: for
    test modules whose contracts both must keep (they alias ``make_engine`` to it)."""

    def make(block_size: int = 16, max_blocks: int | None = 256) -> Engine:
        config = PoolConfig(block_size=block_size, max_blocks=max_blocks)
        return Engine(tiny_model, tiny_tok, pool_config=config, paged_kv=request.param)

    return make


@pytest.fixture
def converse(engine):
    """A conversation on the tiny model; protocol modes get a short protocol prompt (byte tokens are many)."""

    def make(**kwargs) -> Conversation:
        if kwargs.get("generation") is None:  # settings given beside the object holding them are refused
            kwargs.setdefault("max_new_tokens", 8)
        if kwargs.get("config") is None:
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


@pytest.fixture
def context_and_bare_template():
    """``build(conversation, tokenizer, messages)`` adds ``messages`` ((role, content) pairs)
    to a conversation whose system prompt is ``messages``' first and returns (the prompt ids
    the context gives the next reply, the bare chat template's text of the same messages)."""

    def build(conversation, tokenizer, messages: list[tuple[str, str]]) -> tuple[list[int], str]:
        for role, content in messages[1:]:
            conversation.add(role, content)
        prompt = conversation.render_prompt(conversation.next_segment_id()).token_ids
        bare = [{"role": role, "content": content} for role, content in messages]
        return prompt, tokenizer.apply_chat_template(bare, tokenize=False, add_generation_prompt=True)

    return build
