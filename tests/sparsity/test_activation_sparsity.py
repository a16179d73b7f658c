"""Activation sparsity on the default model: `tokenmill calibrate-sparsity` writes thresholds that
zero the target share of held-out activations, the engine reads them (and refuses a malformed or
mismatched file, naming the file and the layer), sparsity 0 changes nothing, and sparsity > 0
changes decode steps but not prefill. The compiled DecoderStack's bit-identity with sparsity is
tests/models/test_cpu_decoder.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.cli import main as cli_main
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.layers.sparsity import LINEAR_INPUTS, sparsify
from tokenmill.sparsity import thresholds
from tokenmill.sparsity.calibrate import layer_inputs, load_dense_model
from tokenmill.sparsity.thresholds import (
    SPARSITY_GRID, ThresholdFileError, default_path, load_thresholds, model_identity,
)

SEQ_LEN = 256
# Engines with a small KV cache (the 2 GiB default takes longer to allocate than these tests run).
ENGINE = {"num_kv_blocks": 64}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, default_model_path) -> Path:
    """Thresholds of the default model from 8 windows of GSM8K (the CLI, as a user runs it)."""
    path = tmp_path_factory.mktemp("sparsity") / "thresholds.json"
    assert cli_main(["calibrate-sparsity", str(default_model_path), "--sequences", "8", "--seq-len", str(SEQ_LEN),
                     "--output", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def identity(default_checkpoint, default_model_path) -> dict:
    return model_identity(default_model_path, default_checkpoint.config)


@pytest.fixture(scope="module")
def dense_llm():
    return LLM("smollm2-135m", **ENGINE)


def generate(llm, prompts=PROMPTS, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=True)
    return llm.generate(prompts, params)


def test_calibrated_thresholds_give_the_target_sparsity_on_held_out_text(calibrated, identity, default_model_path):
    table = load_thresholds(calibrated, identity)
    assert table.sparsities == list(SPARSITY_GRID)
    data = json.loads(calibrated.read_text())
    assert data["calibration"]["tokens"] == 8 * SEQ_LEN and data["model"]["name"] == default_model_path.name
    # Held out: GPL-3, text calibration never saw (it read GSM8K).
    checkpoint, model = load_dense_model(default_model_path, torch.float32, SEQ_LEN)
    from tokenmill.quantization.calibration import calibration_sequences, calibration_texts, prefill_forward

    held_out = calibration_sequences(calibration_texts("gpl3"), checkpoint.tokenizer, 4, SEQ_LEN)
    for target in (0.25, 0.5):
        limits = torch.tensor(table.at(target))
        shares = torch.zeros(limits.shape)

        def count(i, j):
            def hook(_module, args):
                shares[i, j] = (args[0].abs() < limits[i, j]).float().mean()
            return hook

        hooks = [linear.register_forward_pre_hook(count(i, j))
                 for i, linears in enumerate(layer_inputs(model)) for j, linear in enumerate(linears.values())]
        try:
            with torch.inference_mode():
                prefill_forward(model, held_out)
        finally:
            for h in hooks:
                h.remove()
        assert abs(shares.mean().item() - target) < 0.03, (target, shares.mean())
        assert (shares - target).abs().max().item() < 0.12, (target, shares)


def test_sparsify_zeroes_small_entries_of_the_first_rows_only():
    x = torch.tensor([[0.1, -0.5, 0.3], [0.05, 2.0, -0.2], [0.1, 0.1, 0.1]], dtype=torch.float64)
    out = sparsify(x, torch.tensor(0.25), 2)
    assert out.tolist() == [[0.0, -0.5, 0.3], [0.0, 2.0, 0.0], [0.1, 0.1, 0.1]]
    assert sparsify(x, torch.tensor(0.25), 0) is x
    assert sparsify(x, torch.tensor(0.25), 3)[2].tolist() == [0.0, 0.0, 0.0]


def test_thresholds_between_grid_points_are_interpolated(calibrated, identity):
    table = load_thresholds(calibrated, identity)
    low, high, mid = table.at(0.4), table.at(0.45), table.at(0.425)
    assert mid[7][1] == pytest.approx((low[7][1] + high[7][1]) / 2)
    assert all(v == 0 for row in table.at(0.0) for v in row)
    with pytest.raises(ThresholdFileError, match="not 0.97"):
        table.at(0.97)


def test_sparsity_zero_is_the_dense_engine(dense_llm, calibrated):
    expected = [o.outputs[0].token_ids for o in generate(dense_llm)]
    assert [o.outputs[0].token_ids for o in generate(LLM("smollm2-135m", activation_sparsity=0.0, **ENGINE))] == expected
    # and thresholds of sparsity 0 (all 0) zero nothing: the same tokens through the sparse path
    model = dense_llm.engine.core.runner.model
    try:
        model.enable_activation_sparsity(torch.zeros(len(model.layers), len(LINEAR_INPUTS)))
        assert [o.outputs[0].token_ids for o in generate(dense_llm)] == expected
    finally:
        model.sparsity_thresholds = None


def test_sparsity_changes_decode_but_not_prefill(dense_llm, calibrated, monkeypatch):
    dense = generate(dense_llm)
    sparse_llm = LLM("smollm2-135m", activation_sparsity=0.5, activation_sparsity_file=str(calibrated), **ENGINE)
    assert sparse_llm.engine.core.runner.model.sparsity_thresholds is not None
    sparse = generate(sparse_llm)
    for d, s in zip(dense, sparse):
        assert s.prompt_logprobs == d.prompt_logprobs  # prefill is dense
        assert s.outputs[0].token_ids[0] == d.outputs[0].token_ids[0]  # sampled from the prefill's logits
        assert s.outputs[0].logprobs[0] == d.outputs[0].logprobs[0]
    assert any(s.outputs[0].token_ids != d.outputs[0].token_ids for d, s in zip(dense, sparse))
    # sparsifying prefill too (what activation_sparsity_prefill=True sets) changes the prompt's logprobs
    monkeypatch.setattr(sparse_llm.engine.core.runner.model, "sparsify_prefill", True)
    assert generate(sparse_llm, PROMPTS[:1], 1)[0].prompt_logprobs != dense[0].prompt_logprobs


def test_the_file_for_the_model_is_found_where_calibrate_writes_it(calibrated, identity, monkeypatch, tmp_path):
    monkeypatch.setattr(thresholds, "CACHE_DIR", tmp_path)
    with pytest.raises(ConfigError, match="calibrate-sparsity"):
        LLM("smollm2-135m", activation_sparsity=0.4, **ENGINE)
    default_path(identity).parent.mkdir(parents=True, exist_ok=True)
    default_path(identity).write_bytes(calibrated.read_bytes())
    model = LLM("smollm2-135m", activation_sparsity=0.4, **ENGINE).engine.core.runner.model
    expected = torch.tensor(load_thresholds(calibrated, identity).at(0.4))
    assert torch.equal(model.sparsity_thresholds, expected)


def edited(calibrated: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(calibrated.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def set_threshold(data, layer, name, index, value):
    data["layers"][layer][name][index] = value


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["layers"][3].pop("down"), "layer 3: must map exactly qkv, o, gate_up, down"),
    (lambda d: set_threshold(d, 5, "o", 2, -1.0), "layer 5: 'o' holds a threshold that is not a finite number"),
    (lambda d: set_threshold(d, 7, "qkv", 10, 0.0), "layer 7: 'qkv' thresholds decrease"),
    (lambda d: d["layers"][9]["gate_up"].pop(), "layer 9: 'gate_up' must list 20 thresholds"),
    (lambda d: d["layers"].pop(), "layer 29: 29 layers of thresholds, the model has 30"),
    (lambda d: d.update(sparsities=d["sparsities"][::-1]), "'sparsities' must be increasing"),
    (lambda d: d.update(format="something else"), "not a tokenmill-activation-sparsity file"),
])
def test_a_malformed_file_is_refused_naming_the_file_and_the_layer(calibrated, identity, tmp_path, edit, match):
    path = edited(calibrated, tmp_path, edit)
    with pytest.raises(ThresholdFileError, match=match) as e:
        load_thresholds(path, identity)
    assert str(path) in str(e.value)


def test_a_file_that_is_not_json_is_refused(identity, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "tokenmill-activation-sparsity", ')
    with pytest.raises(ThresholdFileError, match=f"{path}: not JSON"):
        load_thresholds(path, identity)


def test_a_file_for_another_model_is_refused_before_the_model_loads(calibrated, tmp_path):
    other = edited(calibrated, tmp_path, lambda d: d["model"].update(fingerprint="0" * 64, name="other.gguf"))
    with pytest.raises(ThresholdFileError, match=f"{other}: calibrated for other.gguf .*fingerprint differ"):
        LLM("smollm2-135m", activation_sparsity=0.4, activation_sparsity_file=str(other), **ENGINE)
    with pytest.raises(ConfigError, match="activation_sparsity_file: .*no such file"):
        LLM("smollm2-135m", activation_sparsity=0.4, activation_sparsity_file=str(tmp_path / "missing.json"))


def test_config_ranges():
    for bad in (-0.1, 0.96, True, "0.4"):
        with pytest.raises(ConfigError, match="activation_sparsity: must be in"):
            EngineConfig(activation_sparsity=bad)
    with pytest.raises(ConfigError, match="activation_sparsity: .*split over ranks"):
        EngineConfig(activation_sparsity=0.4, tensor_parallel_size=2)
