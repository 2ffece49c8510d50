"""A message given as content parts becomes one text: its text parts, one per line.

OpenAI's API (and LangChain's content blocks) let a message be a list of parts;
``["Translate to Spanish:", "Good morning"]`` must not reach the model as
``Translate to Spanish:Good morning``. Parts are joined with a newline, as vLLM's
OpenAI server joins them, in every entry point (``clm serve``, ``ChatCLM``, replays).
"""

from __future__ import annotations

from collections.abc import Iterable

TEXT_PART_SEPARATOR = "\n"


def join_text_parts(parts: Iterable[str]) -> str:
    return TEXT_PART_SEPARATOR.join(parts)
