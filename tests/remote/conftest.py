"""A real llama.cpp server (llama-server) on the bundled SmolLM2 GGUF, started per test module.

The binary comes from ``tests/remote/build_llama_server.sh`` (``make test-remote`` builds it
once and sets ``CLM_LLAMA_SERVER``). Without it these tests skip, unless
``CLM_REQUIRE_REMOTE=1`` (set by ``make test-remote``), where a missing server fails.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from live_server import free_port, wait_until_healthy

from clm_middleware.models.loading import _default_source

DEFAULT_BINARY = Path.home() / ".cache/clm-middleware/llama-server-0.3.36/bin/llama-server"
SLOT_CONTEXT = 4096  # per slot; SmolLM2 trained on 8192


def llama_server_binary() -> Path | None:
    path = Path(os.environ.get("CLM_LLAMA_SERVER") or DEFAULT_BINARY)
    return path if path.is_file() and os.access(path, os.X_OK) else None


@dataclass
class LlamaServer:
    binary: Path
    model: Path
    slots: int = 2
    port: int = 0
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, port: int | None = None) -> LlamaServer:
        self.port = port or free_port()
        self.log_path = log_dir / f"llama-server-{self.port}.log"
        command = [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--ctx-size",
            str(SLOT_CONTEXT * self.slots),
            "--parallel",
            str(self.slots),
            "--threads",
            "2",
            "--no-webui",
            # llama.cpp's AMX repacked weights crash (SIGSEGV in ggml_backend_amx_mul_mat)
            # on CPUs with AMX, as this machine's; plain CPU buffers compute the same.
            "--no-repack",
            "--metrics",  # /metrics: what the server computed, for the tests that count it
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        if not wait_until_healthy(self.process, self.url, self.log_path, "llama-server"):
            self.stop()
            raise AssertionError(f"llama-server did not come up:\n{self.log_path.read_text()[-4000:]}")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        self.process = None


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory) -> Iterator[LlamaServer]:
    binary = llama_server_binary()
    if binary is None:
        if os.environ.get("CLM_REQUIRE_REMOTE") == "1":
            pytest.fail("no llama-server binary: run tests/remote/build_llama_server.sh (make test-remote does)")
        pytest.skip("no llama-server binary (make test-remote builds one)")
    server = LlamaServer(binary, _default_source().path).start(tmp_path_factory.mktemp("llama"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from clm_middleware.models.loading import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def smollm2_scorer():
    from clm_middleware.engine import Engine

    return Engine.from_pretrained()
