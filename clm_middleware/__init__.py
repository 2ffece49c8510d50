"""clm-middleware: a local chat model manages its own context over a block-pool KV cache."""

from clm_middleware.cache import BlockPool, PoolConfig
from clm_middleware.conversation import Conversation
from clm_middleware.engine import CallStats, Engine, Generation, Observe
from clm_middleware.errors import ClmError
from clm_middleware.lifecycle import Decision, Label, Reply, Segment, Segmenter, TurnStats
from clm_middleware.models import load_model, load_tokenizer, model_fingerprint, tiny_llama
from clm_middleware.store import Store

__version__ = "0.1.0"


def __getattr__(name: str):
    """``clm_middleware.ChatCLM``: imported on first use, so the core never loads LangChain."""
    if name == "ChatCLM":
        from clm_middleware.adapters import ChatCLM

        return ChatCLM
    raise AttributeError(f"module 'clm_middleware' has no attribute {name!r}")


__all__ = [
    "BlockPool",
    "CallStats",
    "ChatCLM",
    "ClmError",
    "Conversation",
    "Decision",
    "Engine",
    "Generation",
    "Label",
    "Observe",
    "PoolConfig",
    "Reply",
    "Segment",
    "Segmenter",
    "Store",
    "TurnStats",
    "__version__",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "tiny_llama",
]
