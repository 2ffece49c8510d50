"""An error no handler maps is answered (a counted 500) inside the app, not re-raised."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from clm_middleware.cache.block_pool import PoolStats
from clm_middleware.server.accounting import RequestAccounting
from clm_middleware.server.errors import install_error_handlers
from clm_middleware.server.metrics import ServerMetrics

EMPTY_POOL = PoolStats(0, 16, 0, 0, 0, 0, 0, 0)


def failing_app() -> tuple[FastAPI, ServerMetrics]:
    app = FastAPI()
    metrics = ServerMetrics(lambda: EMPTY_POOL, lambda: 0)
    install_error_handlers(app)
    app.add_middleware(RequestAccounting, metrics=metrics, max_body_bytes=1024)

    @app.get("/broken")
    async def broken() -> dict:
        raise RuntimeError("a bug")

    @app.get("/fine")
    async def fine() -> dict:
        return {"ok": True}

    return app, metrics


def test_an_unexpected_error_is_a_counted_500_and_the_next_request_is_served():
    app, metrics = failing_app()

    async def run() -> tuple[httpx.Response, httpx.Response]:
        # raise_app_exceptions (the default): an exception leaving the app would raise here
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/broken"), await client.get("/fine")

    broken, fine = asyncio.run(run())
    assert broken.status_code == 500
    assert broken.json() == {
        "error": {
            "message": "the server hit an internal error; see its log",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert "a bug" not in broken.text and fine.json() == {"ok": True}
    counted = metrics.registry.get_sample_value("clm_requests_total", {"endpoint": "/broken", "status": "500"})
    assert counted == 1.0
