from __future__ import annotations

import pytest

from tokenmill import LLM


@pytest.fixture(scope="session")
def default_llm(default_model_path):
    """One engine on the default model (dtype auto, as `tokenmill eval` runs it by default)."""
    return LLM(str(default_model_path), kv_cache_memory_gb=0.25)
