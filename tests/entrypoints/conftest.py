"""Fixtures of the server tests (the shared `server` and the `hf_model` oracle are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.serving import BASE_FLAGS, MODEL, ServerProcess


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL  # the served name defaults to the model argument


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    """The default model's tokenizer as Hugging Face reads it from the GGUF: the oracle for usage counts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def keyed_server(default_model_path, tmp_path_factory):
    """A server that requires `Authorization: Bearer sekret` (the web page's tests)."""
    proc = ServerProcess(MODEL, *BASE_FLAGS, "--api-key", "sekret",
                         log_path=tmp_path_factory.mktemp("keyed") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()
