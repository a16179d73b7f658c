"""KV-cache sizing: the GPU-memory arithmetic (exact, plain ints), the config and CLI knobs, and
the runner's profiling step and CUDA sizing path, run on CPU (torch.cuda's memory readings faked)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.cli import build_parser
from tokenmill.config import CPU_KV_CACHE_MEMORY_GB, ConfigError, EngineConfig
from tokenmill.layers import sampler as sampler_module
from tokenmill.layers.sampler import SamplingRow
from tokenmill.models.loader import load_checkpoint
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import model_runner
from tokenmill.worker.cuda_graphs import DecodeGraphs
from tokenmill.worker.memory import GRAPH_POOL_MARGIN, GiB, MemoryProfile, kv_cache_budget_bytes, profile_prompt_lens
from tokenmill.worker.model_runner import ModelRunner

MiB = 2**20


def profile(**kw) -> MemoryProfile:
    values = dict(total=80 * GiB, free=70 * GiB, torch_allocated=3 * GiB, torch_reserved=4 * GiB, peak_activation=2 * GiB)
    return MemoryProfile(**(values | kw))


# -- arithmetic -----------------------------------------------------------------------------------


def test_budget_is_utilization_of_total_less_weights_peak_and_memory_outside_torch():
    p = profile()
    assert p.non_torch == 6 * GiB  # 10 GiB used on the device, 4 of them held by torch
    assert p.in_use == 3 * GiB + 2 * GiB + 6 * GiB
    assert kv_cache_budget_bytes(p, 0.9, min_bytes=1) == int(0.9 * 80 * GiB) - 11 * GiB
    assert kv_cache_budget_bytes(p, 1.0, min_bytes=1) == 69 * GiB


def test_other_processes_count_against_utilization():
    alone = kv_cache_budget_bytes(profile(), 0.9, min_bytes=1)
    shared = kv_cache_budget_bytes(profile(free=50 * GiB), 0.9, min_bytes=1)  # 20 GiB more used elsewhere
    assert alone - shared == 20 * GiB


def test_cached_but_free_torch_memory_is_not_counted_twice():
    # Reserved-but-unallocated memory of torch's pool is neither weights nor outside torch.
    assert profile(torch_reserved=3 * GiB, free=71 * GiB).in_use == profile().in_use


def test_graph_pool_counts_as_in_use():
    assert profile(graph_pool=GiB).in_use == profile().in_use + GiB
    with pytest.raises(ConfigError, match="CUDA graph pool 1.00 GiB.*enforce_eager"):
        kv_cache_budget_bytes(profile(graph_pool=GiB), 0.2, min_bytes=int(0.2 * 80 * GiB) - profile().in_use)


def test_too_little_left_names_gpu_memory_utilization():
    p = profile()
    need = int(0.2 * 80 * GiB) - p.in_use + 1  # one byte more than 0.2 leaves
    with pytest.raises(ConfigError, match="gpu_memory_utilization") as e:
        kv_cache_budget_bytes(p, 0.2, min_bytes=need)
    assert e.value.field == "gpu_memory_utilization"
    assert "max_model_len" in str(e.value) and "weights 3.00 GiB" in str(e.value)
    assert kv_cache_budget_bytes(p, 0.2, min_bytes=need - 1) == need - 1
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):  # nothing left at all
        kv_cache_budget_bytes(p, 0.1, min_bytes=1)


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.01])
def test_budget_rejects_utilization_out_of_range(utilization):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        kv_cache_budget_bytes(profile(), utilization, min_bytes=1)


@pytest.mark.parametrize(
    "budget, seqs, model_len, expected",
    [
        (2048, 128, 8192, [1921] + [1] * 127),  # one long prompt, every other request one token
        (2048, 128, 512, [512, 512, 512, 388] + [1] * 124),  # the long part split at max_model_len
        (16, 128, 8192, [1] * 16),  # fewer tokens than requests
        (2048, 2, 100, [100, 100]),  # max_num_seqs x max_model_len < the token budget
        (1, 1, 1, [1]),
    ],
)
def test_profile_prompt_lens(budget, seqs, model_len, expected):
    assert profile_prompt_lens(budget, seqs, model_len) == expected


# -- config and CLI -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, float("nan"), "0.9", True, None])
def test_config_rejects_gpu_memory_utilization(value):
    with pytest.raises(ConfigError, match="gpu_memory_utilization") as e:
        EngineConfig(gpu_memory_utilization=value)
    assert e.value.field == "gpu_memory_utilization"


@pytest.mark.parametrize("value", [0, -1.0, "2", float("nan")])
def test_config_rejects_kv_cache_memory_gb(value):
    with pytest.raises(ConfigError, match="kv_cache_memory_gb"):
        EngineConfig(kv_cache_memory_gb=value)


def test_kv_cache_memory_auto_is_the_cpu_default_on_cpu_and_profiled_on_cuda():
    auto = EngineConfig(gpu_memory_utilization=1)
    assert auto.kv_cache_memory_gb is None
    assert auto.resolved_kv_cache_memory_gb("cpu") == CPU_KV_CACHE_MEMORY_GB == 2.0
    assert auto.resolved_kv_cache_memory_gb("cuda") is None
    explicit = EngineConfig(kv_cache_memory_gb=0.5)
    assert explicit.resolved_kv_cache_memory_gb("cpu") == explicit.resolved_kv_cache_memory_gb("cuda") == 0.5


def test_cli_flag():
    from tokenmill.cli import engine_config_from_args

    args = build_parser().parse_args(["generate", "--gpu-memory-utilization", "0.5", "--prompt", "x"])
    config = engine_config_from_args(args)
    assert config.gpu_memory_utilization == 0.5 and config.kv_cache_memory_gb is None
    args = build_parser().parse_args(["generate", "--gpu-memory-utilization", "1.5", "--prompt", "x"])
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        engine_config_from_args(args)


# -- the runner -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_qwen2_dir):
    return load_checkpoint(tiny_qwen2_dir)


def make_runner(checkpoint, **kw) -> tuple[ModelRunner, EngineConfig]:
    config = EngineConfig(model="unused", dtype="float32", max_num_batched_tokens=40, max_num_seqs=8,
                          swap_space_gb=0, **kw)
    return ModelRunner(config, checkpoint, "cpu", "float32", max_model_len=64), config


def test_cpu_sizing_is_unchanged(tiny_checkpoint):
    auto, _ = make_runner(tiny_checkpoint)
    assert auto.num_blocks == int(CPU_KV_CACHE_MEMORY_GB * GiB) // auto.bytes_per_block
    explicit, _ = make_runner(tiny_checkpoint, kv_cache_memory_gb=0.01)
    assert explicit.num_blocks == int(0.01 * GiB) // explicit.bytes_per_block
    assert make_runner(tiny_checkpoint, num_kv_blocks=7)[0].num_blocks == 7


def test_worst_case_step_runs_and_leaves_no_trace(tiny_checkpoint, monkeypatch):
    runner, config = make_runner(tiny_checkpoint, num_kv_blocks=4)
    twin, _ = make_runner(tiny_checkpoint, num_kv_blocks=4)
    caches = runner.kv_caches
    lens = profile_prompt_lens(40, 8, 64)
    assert lens == [33] + [1] * 7
    # The sampler's costliest path: every row's vocab sorted in full, the penalties over output tokens.
    sorted_rows, penalized_rows = [], []
    threshold, penalties = sampler_module._top_k_top_p_threshold, sampler_module._apply_frequency_presence_penalties

    def recording_threshold(x, values, *args):
        if values.shape[1] == x.shape[1]:  # the whole vocab, sorted
            sorted_rows.append(len(values))
        return threshold(x, values, *args)

    def recording_penalties(x, rows):
        penalized_rows.extend(len(r.output_token_ids) for r in rows)
        return penalties(x, rows)

    monkeypatch.setattr(sampler_module, "_top_k_top_p_threshold", recording_threshold)
    monkeypatch.setattr(sampler_module, "_apply_frequency_presence_penalties", recording_penalties)
    assert runner.run_worst_case_step(config) == sum(math.ceil(n / 16) for n in lens) * runner.bytes_per_block
    assert sorted_rows == [len(lens)] and sorted(penalized_rows) == [0] * 7 + [1]  # (a 1-token request has no output)
    assert runner.requests == {} and runner.kv_caches is caches
    assert all(t.count_nonzero() == 0 for layer in caches for t in layer)  # the real cache untouched
    # The shared generator of unseeded rows is where it was: the same draws as an unprofiled twin.
    logits = torch.randn(4, tiny_checkpoint.config.vocab_size)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [1], [], [2]) for _ in range(4)]
    assert runner.sampler(logits, rows).token_ids == twin.sampler(logits, rows).token_ids


class FakeCudaMemory:
    """torch.cuda's memory readings for a runner that lives on the CPU: `weights` allocated
    before the profiled step, the step's scratch cache plus `activations` at its peak (the
    graph step's scratch cache plus `graph_activations` at its), `outside` bytes used on the
    device outside torch. The runner takes the CUDA path (auto KV budget)."""

    def __init__(self, monkeypatch, total: int, weights: int, activations: int, outside: int, graph_activations: int = 0):
        self.total, self.weights, self.activations, self.outside = total, weights, activations, outside
        self.graph_activations = graph_activations
        self.scratch = self.graph_scratch = 0
        self.peak = weights
        self.calls: list[str] = []
        run_step, run_graph_step = ModelRunner.run_worst_case_step, ModelRunner.run_graph_step

        def recording_step(runner, config):
            self.scratch = run_step(runner, config)
            self.peak = self.weights + self.scratch + self.activations
            return self.scratch

        def recording_graph_step(runner, config):
            self.graph_scratch = run_graph_step(runner, config)
            self.peak = self.weights + self.graph_scratch + self.graph_activations
            return self.graph_scratch

        monkeypatch.setattr(ModelRunner, "run_worst_case_step", recording_step)
        monkeypatch.setattr(ModelRunner, "run_graph_step", recording_graph_step)
        monkeypatch.setattr(EngineConfig, "resolved_kv_cache_memory_gb", lambda config, device: config.kv_cache_memory_gb)
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda device=None, _n=name: self.calls.append(_n))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.weights)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.weights + 4 * MiB)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda device=None: (self.total - self.weights - 4 * MiB - self.outside, self.total))


def test_cuda_sizing_path(tiny_checkpoint, monkeypatch, caplog):
    """The start-up path on CUDA, run on the CPU: profile inside the constructor, then size."""
    fake = FakeCudaMemory(monkeypatch, total=1024 * MiB, weights=100 * MiB, activations=50 * MiB, outside=300 * MiB)
    with caplog.at_level("INFO", logger="tokenmill.worker.model_runner"):
        runner, config = make_runner(tiny_checkpoint, gpu_memory_utilization=0.75)
    assert fake.scratch > 0 and "reset_peak_memory_stats" in fake.calls and runner.requests == {}
    assert fake.graph_scratch == 0 and "CUDA graph pool" not in caplog.text  # no graphs on the torch backend
    budget = int(0.75 * 1024 * MiB) - (100 + 50 + 300) * MiB
    # The torch backend (the CPU's): each block also gets room for twice its one-layer K/V
    # gathered in the compute dtype (fp32 here).
    arch = tiny_checkpoint.config
    gather = 2 * 2 * 16 * arch.num_key_value_heads * arch.head_dim * 4
    per_block = runner.bytes_per_block + gather
    assert runner.attention_backend == "torch" and runner.num_blocks == budget // per_block
    assert len(runner.kv_caches[0][0]) == runner.num_blocks
    assert f"= {runner.num_blocks} blocks = {runner.num_blocks * 16} tokens" in caplog.text
    assert "weights 0.10 GiB, peak activations 0.05 GiB" in caplog.text
    assert f"gathered K/V {runner.num_blocks * gather / GiB:.2f} GiB" in caplog.text
    # An explicit budget or block count wins over the profile.
    fake.scratch = 0
    assert make_runner(tiny_checkpoint, kv_cache_memory_gb=0.01)[0].num_blocks == int(0.01 * GiB) // runner.bytes_per_block
    assert make_runner(tiny_checkpoint, num_kv_blocks=3)[0].num_blocks == 3
    assert fake.scratch == 0  # no profile ran
    # Just enough, then too little, for one max_model_len (64-token = 4-block) request.
    fake.outside = int(0.75 * 1024 * MiB) - 150 * MiB - 4 * per_block
    assert runner._blocks_for_gpu_memory(config) == 4
    fake.outside += 1
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        make_runner(tiny_checkpoint, gpu_memory_utilization=0.75)


def test_cuda_sizing_reserves_the_larger_gather_of_target_and_draft(tiny_checkpoint, default_model_path, monkeypatch):
    """With a draft model, the torch backend's one-layer gather is the larger of the two models'
    (they run one after the other): here the draft (the default model, 3 KV heads of 64) has the
    larger layers than the tiny target (2 heads of 16)."""
    FakeCudaMemory(monkeypatch, total=1024 * MiB, weights=100 * MiB, activations=50 * MiB, outside=300 * MiB)
    runner, _ = make_runner(tiny_checkpoint, gpu_memory_utilization=0.75, speculative_method="draft",
                            draft_model=str(default_model_path), num_speculative_tokens=2)
    draft = runner.draft_model.config
    target = tiny_checkpoint.config
    assert draft.num_key_value_heads * draft.head_dim > target.num_key_value_heads * target.head_dim
    gather = 2 * 2 * 16 * draft.num_key_value_heads * draft.head_dim * 4
    budget = int(0.75 * 1024 * MiB) - (100 + 50 + 300) * MiB
    assert runner.num_blocks == budget // (runner.bytes_per_block + gather)


def test_cuda_sizing_reserves_the_graph_pool(tiny_checkpoint, monkeypatch, caplog):
    """When decode steps will replay CUDA graphs, the largest captured step (every row padding,
    the Triton backend in its interpreter here) runs once eagerly and GRAPH_POOL_MARGIN x its
    peak is held back from the KV cache."""
    pytest.importorskip("triton")
    fake = FakeCudaMemory(monkeypatch, total=1024 * MiB, weights=100 * MiB, activations=50 * MiB, outside=300 * MiB,
                          graph_activations=20 * MiB)
    monkeypatch.setattr(model_runner, "decode_graphs_unavailable", lambda config, arch, device_type: None)
    captured = []
    monkeypatch.setattr(DecodeGraphs, "_capture", lambda graphs: captured.append(graphs.sizes))
    with caplog.at_level("INFO", logger="tokenmill.worker.model_runner"):
        runner, config = make_runner(tiny_checkpoint, gpu_memory_utilization=0.75, attention_backend="triton")
    assert fake.scratch > 0 and fake.graph_scratch == runner.bytes_per_block  # a scratch cache of one block
    budget = int(0.75 * 1024 * MiB) - (100 + 50 + GRAPH_POOL_MARGIN * 20 + 300) * MiB
    assert runner.num_blocks == budget // runner.bytes_per_block  # (the Triton backend gathers nothing)
    assert f"CUDA graph pool {GRAPH_POOL_MARGIN * 20 / 1024:.2f} GiB ({GRAPH_POOL_MARGIN} x the profiled decode step of 8)" \
        in caplog.text
    assert captured == [[1, 2, 4, 8]] and runner.decode_graphs is not None  # then captured over the real cache
    assert runner.decode_graphs.kv_caches is runner.kv_caches


def test_worst_case_step_runs_the_draft_model_over_the_batch_and_proposes(tiny_checkpoint, default_model_path,
                                                                           monkeypatch):
    """With a draft model the profiled step also runs its forward over every token and its
    proposal passes (one per draft, a token per request)."""
    runner, config = make_runner(tiny_checkpoint, num_kv_blocks=4, speculative_method="draft",
                                 draft_model=str(default_model_path), num_speculative_tokens=2)
    forward = runner.draft_model.forward
    draft_tokens = []

    def recording_forward(input_ids, *args):
        draft_tokens.append(len(input_ids))
        return forward(input_ids, *args)

    monkeypatch.setattr(runner.draft_model, "forward", recording_forward)
    runner.run_worst_case_step(config)
    # [33] + [1] * 7 prompt tokens, then 2 drafts for each of the 8 requests.
    assert draft_tokens == [40, 8, 8]
    assert runner.requests == {}
