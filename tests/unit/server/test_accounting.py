"""An error no handler maps is answered (a counted 500) inside the app, not re-raised."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from clm_middleware.cache.block_pool import PoolStats
from clm_middleware.server.accounting import RequestAccounting
from clm_middleware.server.errors import install_error_handlers
from clm_middleware.server.metrics import ServerMetrics

EMPTY_POOL = PoolStats(0, 16, 0, 0, 0, 0, 0, 0)


def failing_app() -> tuple[FastAPI, ServerMetrics]:
    app = FastAPI()
    metrics = ServerMetrics(lambda: EMPTY_POOL, lambda: 0)
    install_error_handlers(app)
    app.add_middleware(RequestAccounting, metrics=metrics, max_body_bytes=1024, routes=app.router.routes)

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


def test_a_chunked_body_over_the_limit_is_a_413_once_read_past_it():
    app, metrics = failing_app()

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"size": len(body["text"])}

    def chunks(total: int):
        async def stream():
            yield b'{"text": "'
            for _ in range(total // 100):
                yield b"x" * 100
            yield b'"}'

        return stream()

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            # no Content-Length: the size is known only as the chunks arrive
            headers = {"Content-Type": "application/json"}
            over = await client.post("/echo", content=chunks(5000), headers=headers)
            return over, await client.post("/echo", content=chunks(500), headers=headers)

    over, under = asyncio.run(run())
    assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large"
    assert under.status_code == 200 and under.json() == {"size": 500}
    assert metrics.registry.get_sample_value("clm_requests_total", {"endpoint": "/echo", "status": "413"}) == 1.0


def test_a_body_over_the_limit_by_its_content_length_is_counted_under_its_endpoint():
    app, metrics = failing_app()

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"size": len(body["text"])}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/echo", json={"text": "x" * 5000})  # refused before routing

    assert asyncio.run(run()).status_code == 413
    assert metrics.registry.get_sample_value("clm_requests_total", {"endpoint": "/echo", "status": "413"}) == 1.0


def test_a_cors_preflight_and_a_wrong_method_are_counted_under_their_endpoint_not_unmatched():
    """Both are answered before a route takes them (the CORS middleware; the router's 405):
    a path that exists is named, so an operator sees which endpoint browsers ask about."""
    app = FastAPI()
    metrics = ServerMetrics(lambda: EMPTY_POOL, lambda: 0)
    install_error_handlers(app)
    app.add_middleware(CORSMiddleware, allow_origins=["http://ui.example"], allow_methods=["*"])
    app.add_middleware(RequestAccounting, metrics=metrics, max_body_bytes=1024, routes=app.router.routes)

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        return {"ok": True}

    async def run() -> list[httpx.Response]:
        preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [
                await client.options("/v1/chat/completions", headers=preflight),
                await client.get("/v1/chat/completions"),
                await client.get("/nowhere"),
            ]

    assert [r.status_code for r in asyncio.run(run())] == [200, 405, 404]
    sample = metrics.registry.get_sample_value
    assert sample("clm_requests_total", {"endpoint": "/v1/chat/completions", "status": "200"}) == 1.0
    assert sample("clm_requests_total", {"endpoint": "/v1/chat/completions", "status": "405"}) == 1.0
    assert sample("clm_requests_total", {"endpoint": "unmatched", "status": "404"}) == 1.0
