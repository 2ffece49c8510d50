"""The lifecycle layer in front of a serving engine (vLLM, SGLang, llama.cpp's server).

``RemoteEngine`` satisfies ``clm_middleware.engine.protocol.ServingEngine`` over the
server's OpenAI-compatible completions API; see ``docs/deploy.md``.
"""

from clm_middleware.remote.client import ClientConfig, RemoteEngineError
from clm_middleware.remote.engine import RemoteEngine, parse_engine_url

__all__ = ["ClientConfig", "RemoteEngine", "RemoteEngineError", "parse_engine_url"]
