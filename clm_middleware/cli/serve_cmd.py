"""``clm serve``: the OpenAI-compatible HTTP server (clm_middleware/server/, docs/serve.md)."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import click

from clm_middleware.cli.options import (
    OutputPath,
    check_engine_options,
    model_options,
    penalty_options,
    remote_engine_options,
    sampling_filter_options,
    usage_error,
)
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.modes import TAGGING_MODES

API_KEY_ENV = "CLM_API_KEY"


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to bind.")
@click.option(
    "--mode",
    type=click.Choice(["clm", "stateless"]),
    default="clm",
    show_default=True,
    help="clm: managed conversations over the block pool; stateless: recompute every request (a baseline).",
)
@click.option("--served-model-name", default=None, help="The model id clients send [default: the model's name].")
@click.option("--budget", type=click.IntRange(min=64), default=None, help="Max context tokens per prompt.")
@click.option("--k", type=click.IntRange(min=0), default=2, show_default=True, help="Rounds removed blocks are held.")
@click.option(
    "--tagging", type=click.Choice(TAGGING_MODES), default="auto", show_default=True, help="Who labels segments."
)
@click.option(
    "--compact-ahead",
    is_flag=True,
    help="After a reply, compute what the next call would wait for: under --budget the compaction "
    "when the next message would not fit, and the next message's opening (docs/lifecycle.md).",
)
@click.option("--db", type=OutputPath(), default=None, help="SQLite store for the conversations.")
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help=f"Require 'Authorization: Bearer KEY' on /v1 (repeat for several; each key is its own tenant) "
    f"[default: ${API_KEY_ENV} if set].",
)
@click.option(
    "--allowed-origins",
    "allowed_origins",
    multiple=True,
    help="Browser origin allowed to call the API (CORS), e.g. http://localhost:3000, or * for any "
    "(repeat for several) [default: none, same-origin only].",
)
@click.option(
    "--max-sessions", type=click.IntRange(min=1), default=64, show_default=True, help="Open sessions per tenant."
)
@click.option(
    "--max-concurrent-turns",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Turns generating at once; further requests wait for a free slot.",
)
@click.option(
    "--pool-wait",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds a request the KV pool has no room for waits, in line, for running turns to end "
    "before it is answered 503 (0: at once).",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Reply length cap when a request gives none.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0, 2),
    default=0.0,
    show_default=True,
    help="Sampling temperature when a request gives none (0: greedy).",
)
@sampling_filter_options
@penalty_options
@model_options
@remote_engine_options
def serve(
    host: str,
    port: int,
    mode: str,
    served_model_name: str | None,
    budget: int | None,
    k: int,
    tagging: str,
    compact_ahead: bool,
    db: Path | None,
    api_keys: tuple[str, ...],
    allowed_origins: tuple[str, ...],
    max_sessions: int,
    max_concurrent_turns: int,
    pool_wait: float,
    max_tokens: int,
    temperature: float,
    top_k: int | None,
    min_p: float | None,
    repetition_penalty: float | None,
    frequency_penalty: float,
    presence_penalty: float,
    no_repeat_ngram_size: int | None,
    **engine_options: Any,
) -> None:
    """Serve the OpenAI chat-completions API with managed context (docs/serve.md)."""
    check_engine_options(engine_options)  # a clash of engine options, before any model loads
    import uvicorn

    from clm_middleware.cli.setup import build_engine
    from clm_middleware.lifecycle.config import GenerationSettings
    from clm_middleware.lifecycle.tagging import TaggingConfig
    from clm_middleware.server import ChatService, ServerConfig, create_app
    from clm_middleware.store import Store

    TaggingConfig(mode=tagging)  # a wrong mode fails here, naming the field, before the model loads
    keys = api_keys or tuple(k for k in [os.environ.get(API_KEY_ENV)] if k)
    ctx = click.get_current_context()
    _check_host(host, port)
    generation = GenerationSettings(
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    try:  # every setting is checked, and the store opened, before the model loads
        config = ServerConfig(
            model_id=served_model_name or "",
            mode=mode,
            budget=budget,
            k=k,
            tagging=tagging,
            compact_ahead=compact_ahead,
            db=str(db) if db else None,
            api_keys=keys,
            allowed_origins=allowed_origins,
            max_sessions=max_sessions,
            max_concurrent_turns=max_concurrent_turns,
            pool_wait_s=pool_wait,
            generation=generation,
        )
        if db is not None:
            Store(db).close()  # not a usable store: said now, not as a 500 on every request
        engine = build_engine(**engine_options)
        config = dataclasses.replace(config, model_id=config.model_id or engine.model_name)
        service = ChatService(engine, config, owns_engine=True)  # refuses a budget over the engine's window
    except ConfigError as error:
        raise usage_error(error, ctx) from None
    if host not in ("127.0.0.1", "localhost", "::1") and not keys:
        click.echo(f"warning: serving on {host} with no --api-key: anyone who can reach it can use it", err=True)
    click.echo(f"clm serve: model {config.model_id!r}, mode {mode}, http://{host}:{port}/v1", err=True)
    # SIGTERM / Ctrl-C: uvicorn stops accepting, lets in-flight requests finish (up to 30 s),
    # then the app's shutdown closes every session and the engine
    uvicorn.run(create_app(service), host=host, port=port, log_level="info", timeout_graceful_shutdown=30)


def _check_host(host: str, port: int) -> None:
    """``--host`` must name an address this machine can bind, checked before the model
    loads: uvicorn said so only after the start banner, and exited 3."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as error:
        raise click.BadParameter(f"{host!r} is not an address to bind ({error})", param_hint="--host") from None
