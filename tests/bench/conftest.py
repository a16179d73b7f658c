"""A real `tokenmill serve` for the end-to-end bench tests (slow: it loads the default model).

It reuses the server tests' `ServerProcess` with their flags, but is its own session fixture, so
`pytest tests/bench` runs alone.
"""

from __future__ import annotations

import pytest

from tests.entrypoints.conftest import BASE_FLAGS, MODEL, ServerProcess


@pytest.fixture(scope="session")
def bench_server(default_model_path, tmp_path_factory):
    proc = ServerProcess(MODEL, *BASE_FLAGS, log_path=tmp_path_factory.mktemp("bench_server") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()
