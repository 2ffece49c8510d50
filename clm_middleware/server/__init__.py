"""``clm serve``: an OpenAI-compatible HTTP server over managed conversations (docs/serve.md)."""

from .app import create_app
from .service import ChatService, ServerConfig

__all__ = ["ChatService", "ServerConfig", "create_app"]
