"""The protocol and summarizer prompts: files in ``clm_middleware.prompts``, or the user's own.

Files are read with ``importlib.resources``, which works for an installed wheel and an
editable install alike.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from clm_middleware.errors import ConfigError

PROTOCOL_PROMPT = "protocol.md"
SUMMARIZER_PROMPT = "summarizer.md"


def bundled_prompt(name: str) -> str:
    return resources.files("clm_middleware.prompts").joinpath(name).read_text(encoding="utf-8").strip()


def resolve_prompt(value: str | Path | None, default_name: str) -> str:
    """``None`` → the bundled file; a ``Path`` → that file's text; a ``str`` → the text itself."""
    if value is None:
        return bundled_prompt(default_name)
    if isinstance(value, Path):
        try:
            return value.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ConfigError("prompt", f"cannot read {value}: {error.strerror}") from None
    return value.strip()


def summarizer_prompt(value: str | Path | None = None) -> str:
    text = resolve_prompt(value, SUMMARIZER_PROMPT)
    if "{text}" not in text:
        raise ConfigError("summarizer_prompt", "must contain the placeholder {text}")
    return text
