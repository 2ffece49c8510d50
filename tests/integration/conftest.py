"""The real default model, loaded once per session (converted weights are cached on disk)."""

from __future__ import annotations

import pytest

from clm_middleware.engine import Engine


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def smol_engine() -> Engine:
    return Engine.from_pretrained()
