"""Requests the KV pool has no room for wait in line for running turns (server/pool_room.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from clm_middleware.errors import ConfigError
from clm_middleware.server import ServerConfig
from clm_middleware.server.pool_room import PoolRoom

TIMEOUT_S = 120


async def never_gone() -> bool:
    return False


async def test_the_first_in_line_tries_once_per_ended_turn_and_the_next_only_after_it_leaves():
    lengths: list[int] = []
    room = PoolRoom(wait_s=10, on_line_change=lengths.append)
    room.turn_started()
    first, second = room.join(tried=True), room.join(tried=False)
    deadline = time.monotonic() + 5
    waiting_first = asyncio.create_task(room.my_turn(first, deadline, never_gone, 0.01))
    waiting_second = asyncio.create_task(room.my_turn(second, deadline, never_gone, 0.01))
    await asyncio.sleep(0.05)
    assert not waiting_first.done() and not waiting_second.done()  # refused just now: waits for a turn to end
    room.turn_ended()
    assert await asyncio.wait_for(waiting_first, 1) == "try"
    room.turn_started()  # the first was admitted this time...
    await asyncio.sleep(0.05)
    assert not waiting_second.done()  # ...and the second never overtakes it while it is in line
    room.leave(first)
    assert await asyncio.wait_for(waiting_second, 1) == "try"  # first in line, not tried yet: at once
    room.leave(second)
    assert lengths == [1, 2, 1, 0]  # the metric clm_requests_waiting_for_pool follows the line


async def test_a_refused_first_in_line_waits_for_the_next_end_and_gives_up_at_its_deadline():
    room = PoolRoom(wait_s=10)
    room.turn_started()
    ticket = room.join(tried=True)
    room.turn_ended()
    assert await room.my_turn(ticket, time.monotonic() + 1, never_gone, 0.01) == "try"
    room.refused(ticket)  # refused again: the same end never makes it try twice
    started = time.monotonic()
    assert await room.my_turn(ticket, started + 0.2, never_gone, 0.01) == "timeout"
    assert time.monotonic() - started >= 0.2


async def test_a_waiting_request_whose_client_left_says_gone():
    room = PoolRoom(wait_s=10)
    room.turn_started()
    ticket = room.join(tried=True)

    async def gone() -> bool:
        return True

    assert await room.my_turn(ticket, time.monotonic() + 5, gone, 0.01) == "gone"


@pytest.mark.parametrize("wait", [-1.0, float("nan")])
def test_a_negative_or_nan_pool_wait_is_refused_naming_it(wait):
    with pytest.raises(ConfigError, match="pool_wait_s"):
        ServerConfig(model_id="m", pool_wait_s=wait)


def test_a_burst_the_pool_cannot_hold_at_once_is_served_in_line_without_a_503(tmp_path, launch):
    # 24 blocks of 16 tokens; each request needs ~19 of them (a ~100-token prompt plus 200
    # new tokens), so no two run at once: without the line, all but one were refused 503
    server = launch(tmp_path, "--max-kv-bytes", str(24 * 8192), "--max-concurrent-turns", "4")
    try:
        model_id = httpx.get(server.api + "/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        statuses: dict[int, int] = {}
        barrier = threading.Barrier(4)

        def ask(number: int) -> None:
            words = " ".join(f"word{number}x{i}" for i in range(8))
            body = {"model": model_id, "messages": [{"role": "user", "content": words}], "max_tokens": 200}
            barrier.wait(timeout=TIMEOUT_S)
            response = httpx.post(
                server.api + "/chat/completions",
                content=json.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=TIMEOUT_S,
            )
            statuses[number] = response.status_code

        threads = [threading.Thread(target=ask, args=(number,)) for number in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=TIMEOUT_S)
        assert statuses == {0: 200, 1: 200, 2: 200, 3: 200}
        assert server.metric("clm_pool_blocks_in_use") <= 24
        assert server.metric("clm_requests_waiting_for_pool") == 0
    finally:
        server.stop()
