"""Build engines and drivers for CLI commands from their common options."""

from __future__ import annotations

from collections.abc import Callable

from clm_middleware.cache import PoolConfig
from clm_middleware.engine import Engine
from clm_middleware.render import ChatFormat
from clm_middleware.replay.runner import PlainChatDriver, ReplayOptions, TurnDriver
from clm_middleware.replay.transcript import Transcript

TINY_MODEL = "tiny"  # the random test model: exercises every path in milliseconds


def build_engine(
    model: str | None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    block_size: int = 16,
    max_kv_bytes: int | None = None,
    max_blocks: int | None = None,
) -> Engine:
    pool_config = PoolConfig(block_size=block_size, max_kv_bytes=max_kv_bytes, max_blocks=max_blocks)
    if model == TINY_MODEL:
        from clm_middleware.models import tiny_llama, tiny_tokenizer

        return Engine(tiny_llama(), tiny_tokenizer(), pool_config=pool_config)
    return Engine.from_pretrained(model, device=device, dtype=dtype, pool_config=pool_config)


def sibling_engine(engine: Engine) -> Engine:
    """Same weights and tokenizer, its own pool: modes under comparison never share blocks."""
    return Engine(engine.model, engine.tokenizer, pool_config=engine.pool.config)


def plain_driver_factory(engine: Engine, options: ReplayOptions) -> Callable[[Transcript], TurnDriver]:
    chat_format = ChatFormat.from_tokenizer(engine.tokenizer)
    return lambda transcript: PlainChatDriver(engine, chat_format, options, transcript.conversation_id)
