"""Token-level prompt rendering."""

from clm_middleware.render.chat_format import ChatFormat, RoleGlue

__all__ = ["ChatFormat", "RoleGlue"]
