"""A live ``clm serve`` on 127.0.0.1 and a free port, as a subprocess, for tests to drive."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
CLM = str(Path(sys.executable).parent / "clm")


@dataclass
class LiveServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def metric(self, name: str) -> float:
        """A sample's value from /metrics (the first line that starts with ``name``)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; the exit code (uvicorn re-raises the
        signal after its graceful shutdown, so a clean stop is 0 or -SIGTERM)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(tmp_path: Path, *args: str, model: str | None = "tiny") -> LiveServer:
    """Start ``clm serve`` (``model=None``: the default SmolLM2) and wait until it answers."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [CLM, "serve", "--host", "127.0.0.1", "--port", str(port), *(["--model", model] if model else []), *args]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    server = LiveServer(process, f"http://127.0.0.1:{port}", log)
    if not wait_until_healthy(process, server.url, log, "clm serve"):
        server.stop()
        raise AssertionError(f"clm serve did not come up in {START_TIMEOUT_S} s:\n{log.read_text()}")
    return server


def wait_until_healthy(process: subprocess.Popen, url: str, log: Path, name: str) -> bool:
    """Poll ``url/health`` until it answers 200 (True) or ``START_TIMEOUT_S`` pass (False);
    a process that exits meanwhile fails with its log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    return False
