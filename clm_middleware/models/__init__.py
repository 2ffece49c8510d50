"""Model loading, the tiny test model, and model fingerprints."""

from clm_middleware.models.fingerprint import model_fingerprint
from clm_middleware.models.loading import (
    DEFAULT_MODEL,
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_model_source,
)
from clm_middleware.models.scripted import ScriptedReplies
from clm_middleware.models.tiny import tiny_llama, tiny_tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "ModelSource",
    "ScriptedReplies",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "resolve_model_source",
    "tiny_llama",
    "tiny_tokenizer",
]
