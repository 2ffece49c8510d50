"""clm-middleware: a local chat model manages its own context over a block-pool KV cache."""

from clm_middleware.cache import BlockPool, PoolConfig
from clm_middleware.engine import CallStats, Engine, Generation
from clm_middleware.errors import ClmError
from clm_middleware.models import load_model, load_tokenizer, model_fingerprint, tiny_llama

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "CallStats",
    "ClmError",
    "Engine",
    "Generation",
    "PoolConfig",
    "__version__",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "tiny_llama",
]
