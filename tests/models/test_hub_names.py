"""Hugging Face repository ids as model names, resolved through huggingface_hub's cache (filled
here by the test itself, in the cache's own layout) and refused plainly when missing offline."""

from __future__ import annotations

import shutil

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.models.registry import ModelNotFoundError, resolve_model

constants = pytest.importorskip("huggingface_hub.constants")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def fill(cache, repo_id: str, source) -> None:
    """Put `source`'s files into `cache` as huggingface_hub stores a downloaded snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(source, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def test_repo_id_resolves_from_the_cache_and_generates(hub_cache, tiny_qwen2_dir):
    fill(hub_cache, "acme/Tiny-Qwen2", tiny_qwen2_dir)
    path = resolve_model("acme/Tiny-Qwen2")
    assert path == hub_cache / "models--acme--Tiny-Qwen2" / "snapshots" / COMMIT
    out = LLM("acme/Tiny-Qwen2", dtype="float32", kv_cache_memory_gb=0.02).generate(
        ["Hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_missing_repo_offline_says_what_is_missing(hub_cache):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("acme/Not-Downloaded")
    message = str(info.value)
    assert "'acme/Not-Downloaded'" in message and str(hub_cache) in message and "HF_HUB_OFFLINE" in message


def test_plain_missing_names_are_not_repo_ids(hub_cache):
    for name in ("no-such-model", "/no/such/file.gguf", "a/b/c"):
        with pytest.raises(ModelNotFoundError, match="neither a known alias nor an existing path"):
            resolve_model(name)
