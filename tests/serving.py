"""A real `tokenmill serve` process on 127.0.0.1, for the tests that talk HTTP to one.

`ServerProcess` starts the CLI in a subprocess on a free port and waits for `/health`. The
session-scoped `server` fixture (tests/conftest.py) is one such process shared by every test that
does not need its own flags.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m"  # served by its alias, as users do
# The server under test runs in fp32 so that greedy output does not depend on batch shape.
BASE_FLAGS = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory-gb", "0.25",
              "--max-num-batched-tokens", "256", "--log-stats-interval", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *flags: str, log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "--log-level", "INFO", "serve", str(model),
             "--host", "127.0.0.1", "--port", str(self.port), *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        self.saw_loading = False  # /health answered 503 before 200

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200:
                    return self
                self.saw_loading = self.saw_loading or r.status_code == 503
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def scrape_metrics(url: str) -> dict[str, float]:
    """Every sample of a server's /metrics, keyed `name` or `name{label=value}` (model_name
    dropped: one model per server)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
