"""The lifecycle layer in front of a serving engine (vLLM, SGLang, llama.cpp's server).

``RemoteEngine`` satisfies ``clm_middleware.engine.protocol.ServingEngine`` over the
server's OpenAI-compatible completions API; see ``docs/deploy.md``. Names are imported
on first use, so a light submodule (``signals``) loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clm_middleware.lazy import lazy_namespace

_EXPORTS = {
    "ClientConfig": "clm_middleware.remote.client",
    "RemoteEngine": "clm_middleware.remote.engine",
    "RemoteEngineError": "clm_middleware.errors",
    "parse_engine_url": "clm_middleware.remote.engine",
}

if TYPE_CHECKING:
    from clm_middleware.errors import RemoteEngineError
    from clm_middleware.remote.client import ClientConfig
    from clm_middleware.remote.engine import RemoteEngine, parse_engine_url

__getattr__, __dir__ = lazy_namespace(__name__, globals(), _EXPORTS)

__all__ = [
    "ClientConfig",
    "RemoteEngine",
    "RemoteEngineError",
    "parse_engine_url",
]
