"""Adapters to agent frameworks. ``from clm_middleware.adapters import ChatCLM``."""

from .langchain import ChatCLM

__all__ = ["ChatCLM"]
