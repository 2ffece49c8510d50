"""clm-middleware: a local chat model manages its own context over a block-pool KV cache.

Every name is imported on first use (``lazy.py``), so ``import clm_middleware`` and the
``clm`` command's start-up (``clm --help``, an argument error) load neither torch nor
transformers nor LangChain until something needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clm_middleware.lazy import lazy_namespace

__version__ = "0.1.0"

_EXPORTS = {
    "BlendConfig": "clm_middleware.engine.blend",
    "BlockPool": "clm_middleware.cache",
    "CallStats": "clm_middleware.engine",
    "ChatCLM": "clm_middleware.adapters",
    "ChatTemplateError": "clm_middleware.errors",
    "ClmError": "clm_middleware.errors",
    "ConfigError": "clm_middleware.errors",
    "ContextBudgetError": "clm_middleware.errors",
    "ContextWindowError": "clm_middleware.errors",
    "Conversation": "clm_middleware.conversation",
    "ConversationBusyError": "clm_middleware.errors",
    "ConversationExistsError": "clm_middleware.errors",
    "Decision": "clm_middleware.lifecycle",
    "Engine": "clm_middleware.engine",
    "Generation": "clm_middleware.engine",
    "GenerationSettings": "clm_middleware.lifecycle.config",
    "Label": "clm_middleware.lifecycle",
    "LifecycleConfig": "clm_middleware.lifecycle.config",
    "ModelNotFoundError": "clm_middleware.errors",
    "Observe": "clm_middleware.engine",
    "PoolConfig": "clm_middleware.cache",
    "PoolExhaustedError": "clm_middleware.errors",
    "PoolTooSmallError": "clm_middleware.errors",
    "RemoteEngineError": "clm_middleware.errors",
    "Reply": "clm_middleware.lifecycle",
    "Segment": "clm_middleware.lifecycle",
    "Segmenter": "clm_middleware.lifecycle",
    "Store": "clm_middleware.store",
    "StoreError": "clm_middleware.errors",
    "TranscriptError": "clm_middleware.errors",
    "TurnCancelled": "clm_middleware.errors",
    "TurnStats": "clm_middleware.lifecycle",
    "UnsupportedModelError": "clm_middleware.errors",
    "load_model": "clm_middleware.models",
    "load_tokenizer": "clm_middleware.models",
    "model_fingerprint": "clm_middleware.models",
    "tiny_llama": "clm_middleware.models",
}

if TYPE_CHECKING:
    from clm_middleware.adapters import ChatCLM
    from clm_middleware.cache import BlockPool, PoolConfig
    from clm_middleware.conversation import Conversation
    from clm_middleware.engine import CallStats, Engine, Generation, Observe
    from clm_middleware.engine.blend import BlendConfig
    from clm_middleware.errors import (
        ChatTemplateError,
        ClmError,
        ConfigError,
        ContextBudgetError,
        ContextWindowError,
        ConversationBusyError,
        ConversationExistsError,
        ModelNotFoundError,
        PoolExhaustedError,
        PoolTooSmallError,
        RemoteEngineError,
        StoreError,
        TranscriptError,
        TurnCancelled,
        UnsupportedModelError,
    )
    from clm_middleware.lifecycle import Decision, Label, Reply, Segment, Segmenter, TurnStats
    from clm_middleware.lifecycle.config import GenerationSettings, LifecycleConfig
    from clm_middleware.models import load_model, load_tokenizer, model_fingerprint, tiny_llama
    from clm_middleware.store import Store

__getattr__, __dir__ = lazy_namespace(__name__, globals(), _EXPORTS)

__all__ = [
    "BlendConfig",
    "BlockPool",
    "CallStats",
    "ChatCLM",
    "ChatTemplateError",
    "ClmError",
    "ConfigError",
    "ContextBudgetError",
    "ContextWindowError",
    "Conversation",
    "ConversationBusyError",
    "ConversationExistsError",
    "Decision",
    "Engine",
    "Generation",
    "GenerationSettings",
    "Label",
    "LifecycleConfig",
    "ModelNotFoundError",
    "Observe",
    "PoolConfig",
    "PoolExhaustedError",
    "PoolTooSmallError",
    "RemoteEngineError",
    "Reply",
    "Segment",
    "Segmenter",
    "Store",
    "StoreError",
    "TranscriptError",
    "TurnCancelled",
    "TurnStats",
    "UnsupportedModelError",
    "__version__",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "tiny_llama",
]
