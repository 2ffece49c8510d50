"""Fixtures: a live ``clm serve`` on the tiny model (tests/live_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from live_server import LiveServer, start_server


@pytest.fixture(scope="session")
def launch():
    """``start_server(tmp_path, *args)``: a server of one's own (stop it when done)."""
    return start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("serve"), "--max-tokens", "12")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return httpx.get(server.api + "/models", timeout=10).json()["data"][0]["id"]
