"""Malformed model files fail with the loader's declared error (`ModelLoadError`), at once and
in bounded memory: truncated GGUF files, corrupted bytes anywhere in a GGUF's metadata and tensor
index (searched by hypothesis), absurd counts, and damaged Hugging Face directories. Nothing in
the package unpickles or fetches files on its own."""

from __future__ import annotations

import os
import re
import resource
import shutil
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.models.test_families_gguf import COMMON, random_model, write_gguf
from tokenmill.models.gguf_file import GgufFile
from tokenmill.models.loader import ModelLoadError, load_checkpoint

transformers = pytest.importorskip("transformers")

# A load that fails must fail this fast, and grow the process by no more than this.
FAIL_SECONDS = 1.0
FAIL_GROWTH_BYTES = 256 << 20
TOKENMILL = Path(__file__).resolve().parents[2] / "tokenmill"


@pytest.fixture(scope="module")
def tiny_gguf_path(tmp_path_factory) -> Path:
    config = transformers.LlamaConfig(**(COMMON | {"num_hidden_layers": 2}))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, "llama", random_model(config))
    load_checkpoint(path)  # the intact file loads
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_gguf_path) -> bytes:
    return tiny_gguf_path.read_bytes()


@pytest.fixture(scope="module")
def index_end(tiny_gguf_path) -> int:
    """The end of the header, metadata and tensor index (where the aligned tensor data begins)."""
    return min(t.data_offset for t in GgufFile(tiny_gguf_path).tensors)



def _fails_cleanly(path: Path) -> None:
    """Loading `path` either works or raises ModelLoadError, within FAIL_SECONDS and FAIL_GROWTH_BYTES."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    try:
        load_checkpoint(path)
    except ModelLoadError:
        pass
    elapsed = time.perf_counter() - t0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert elapsed < FAIL_SECONDS, f"took {elapsed:.2f} s"
    assert grown < FAIL_GROWTH_BYTES, f"grew by {grown >> 20} MiB"


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.05, 0.2, 0.5, 0.9, 0.999])
def test_truncated_gguf(tiny_gguf, tmp_path, fraction):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf[: int(len(tiny_gguf) * fraction)])
    with pytest.raises(ModelLoadError):
        load_checkpoint(path)
    _fails_cleanly(path)


@pytest.mark.parametrize("offset,value", [(8, 1 << 62), (16, 1 << 62), (8, 10**6)])  # tensor count, metadata count
def test_absurd_counts(tiny_gguf, tmp_path, offset, value):
    path = tmp_path / "counts.gguf"
    path.write_bytes(tiny_gguf[:offset] + struct.pack("<Q", value) + tiny_gguf[offset + 8 :])
    with pytest.raises(ModelLoadError, match="metadata entries|tensors|truncated"):
        load_checkpoint(path)


def test_a_string_length_past_the_end(tiny_gguf, tmp_path):
    path = tmp_path / "string.gguf"  # the first key's length: offset 24
    path.write_bytes(tiny_gguf[:24] + struct.pack("<Q", 1 << 40) + tiny_gguf[32:])
    with pytest.raises(ModelLoadError, match="string"):
        load_checkpoint(path)


# scripts/fuzz_gguf.py runs this search for longer (TOKENMILL_FUZZ_EXAMPLES).
@settings(max_examples=int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_gguf_metadata(tiny_gguf, index_end, tmp_path, data):
    """Bytes overwritten anywhere in the header, metadata and tensor index (with values that make
    counts, lengths, types and offsets absurd as often as plausible)."""
    blob = bytearray(tiny_gguf)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, index_end - 1))
        patch = data.draw(st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\x7f", b"\x09\x00\x00\x00", struct.pack("<Q", 1 << 33)])
                          | st.binary(min_size=1, max_size=8))
        blob[at : at + len(patch)] = patch
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(blob[: len(tiny_gguf)]))
    _fails_cleanly(path)


def test_damaged_hf_directories(tiny_qwen2_dir, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ModelLoadError):
        load_checkpoint(broken)
    shutil.copy(next(Path(tiny_qwen2_dir).glob("*.safetensors")), weights)
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": -4')  # not JSON
    with pytest.raises(ModelLoadError):
        load_checkpoint(broken)
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": 1e12, "num_hidden_layers": 1e15}')
    with pytest.raises(ModelLoadError):
        load_checkpoint(broken)


def test_no_unpickling_and_no_fetching_of_our_own():
    """torch.load only with weights_only=True, no pickle outside the messages one engine's ranks
    send each other (executor/, distributed/: from the engine's own process, through a pipe or a
    file only this user can write); the code that loads models and runs them fetches no URL (a
    repository id goes through huggingface_hub, in models/registry.py; the bench client's requests
    go to the server it is pointed at)."""
    rank_messages = {"executor", "distributed"}
    for source in TOKENMILL.rglob("*.py"):
        text = source.read_text()
        if source.parent.name not in rank_messages:
            assert not re.search(r"^\s*import pickle|\bpickle\.loads?\(", text, re.M), source
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (source, call)
        if source.parent.name in ("models", "quantization", "layers", "worker", "engine", "core"):
            assert not re.search(r"\burllib\.request\b|(?<![.\w])requests\.get\(|(?<![.\w])httpx\.", text), source
