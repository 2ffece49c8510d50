"""Which engine settings go together: checked before anything heavy loads.

Light on purpose (no torch, no transformers): the CLI checks its options with it before
it imports the model stack or loads a model (a clash had been reported after the
seconds a load takes), ``ChatCLM`` at construction, the ``Engine`` at its own.
"""

from __future__ import annotations

from typing import Any

from clm_middleware.errors import ConfigError

LOCAL_ENGINE_SETTINGS = ("approximate_reuse", "paged_kv", "quantization", "compile_decode")
"""Settings of the local engine's KV cache and weights, which a serving engine refuses."""


def refuse_local_settings(**settings: Any) -> None:
    """``ConfigError`` naming the first of :data:`LOCAL_ENGINE_SETTINGS` that is set (not
    None or False) in ``settings``: with a serving engine it would do nothing."""
    for name in LOCAL_ENGINE_SETTINGS:
        value = settings.get(name)
        if value is not None and value is not False:
            raise ConfigError(name, "applies to the local engine; a serving engine keeps its own KV cache")


def refuse_paged_approximate_reuse(paged_kv: bool, approximate_reuse: bool) -> None:
    """Approximate reuse re-rotates K/V inside a working arena, which ``paged_kv`` has not."""
    if paged_kv and approximate_reuse:
        raise ConfigError("paged_kv", "approximate reuse moves K/V inside a working arena; it cannot run with paged_kv")


def check_engine_settings(engine_url: str | None = None, **settings: Any) -> None:
    """The clashes among an engine's settings (``engine_url`` and the local settings by
    name, as the CLI's options and ``ChatCLM``'s fields spell them)."""
    if engine_url:
        refuse_local_settings(**settings)
    refuse_paged_approximate_reuse(bool(settings.get("paged_kv")), settings.get("approximate_reuse") is not None)
