"""Block copies of the KV cache against their plain semantics: swaps as runs of slice copies
against one index_select / index_copy_ per tensor, copy-on-write batched against the copies
one after another; then the Triton backend through an engine that swaps."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.worker.block_copies import copy_blocks, host_runs, resolve_copies, swap_blocks

NUM_DEVICE, NUM_HOST = 12, 10


def caches(num_blocks: int, quantized: bool, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Two layers of (key, value) or (key codes, value codes, key scales, value scales), random."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)

    def layer():
        if not quantized:
            return tuple(torch.randn(shape, generator=gen) for _ in range(2))
        return (torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen),
                torch.randn(shape, generator=gen).to(torch.float8_e4m3fn),
                torch.rand(shape[:-1], generator=gen), torch.rand(shape[:-1], generator=gen))

    return [layer() for _ in range(2)]


def plain_swap(device, host, pairs, out):
    """The copies as one gather and one scatter per tensor (what the runner did before)."""
    dev_ids = torch.tensor([p[0 if out else 1] for p in pairs])
    host_ids = torch.tensor([p[1 if out else 0] for p in pairs])
    for dev_layer, host_layer in zip(device, host):
        for d, h in zip(dev_layer, host_layer):
            d, h = (d.view(torch.uint8), h.view(torch.uint8)) if d.dtype == torch.float8_e4m3fn else (d, h)
            if out:
                h.index_copy_(0, host_ids, d.index_select(0, dev_ids))
            else:
                d.index_copy_(0, dev_ids, h.index_select(0, host_ids))


def same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for la, lb in zip(a, b) for x, y in zip(la, lb))


def test_host_runs():
    # (device, host) pairs, out of order: host 2-4 is one run (its device blocks 7, 8, 9 too), host 6-7 one
    # whose device blocks are not consecutive, host 9 alone.
    pairs = [(9, 4), (1, 6), (7, 2), (8, 3), (0, 7), (5, 9)]
    assert host_runs(pairs, host_side=1) == [(2, [7, 8, 9]), (6, [1, 0]), (9, [5])]
    assert host_runs([(h, d) for d, h in pairs], host_side=0) == [(2, [7, 8, 9]), (6, [1, 0]), (9, [5])]
    assert host_runs([], host_side=1) == []
    with pytest.raises(AssertionError, match="host block 3"):
        host_runs([(1, 3), (2, 3)], host_side=1)


SWAPS = {
    "one run": [(3, 0), (4, 1), (5, 2)],
    "runs and gaps": [(0, 5), (1, 6), (8, 7), (2, 9), (11, 0), (10, 1)],
    "device scattered": [(7, 2), (1, 3), (4, 4), (6, 8)],
    "reversed": [(5, 0), (4, 1), (3, 2), (2, 3)],
    "single": [(11, 9)],
}


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8+fp8"])
@pytest.mark.parametrize("name", list(SWAPS))
def test_swap_out_and_in_match_the_plain_copies(name, quantized):
    pairs = SWAPS[name]
    device, host = caches(NUM_DEVICE, quantized, 0), caches(NUM_HOST, quantized, 1)
    ref_device, ref_host = caches(NUM_DEVICE, quantized, 0), caches(NUM_HOST, quantized, 1)
    swap_blocks(device, host, pairs, out=True)
    plain_swap(ref_device, ref_host, pairs, out=True)
    assert same(host, ref_host) and same(device, ref_device)
    # In again, into other device blocks: (host block, device block), the device ones shuffled.
    targets = random.Random(name).sample(range(NUM_DEVICE), len(pairs))
    back = [(h, d) for (_, h), d in zip(pairs, targets)]
    swap_blocks(device, host, back, out=False)
    plain_swap(ref_device, ref_host, back, out=False)
    assert same(device, ref_device) and same(host, ref_host)
    for (d0, _), d1 in zip(pairs, targets):  # the round trip: block d0's content is now in d1
        for layer, original in zip(device, caches(NUM_DEVICE, quantized, 0)):
            for t, o in zip(layer, original):
                assert torch.equal(t[d1].view(torch.uint8), o[d0].view(torch.uint8))


def sequential(cache: torch.Tensor, pairs) -> None:
    for src, dst in pairs:
        cache[dst].copy_(cache[src])


@pytest.mark.parametrize(
    "pairs, resolved",
    [
        ([(1, 2), (3, 4)], [(1, 2), (3, 4)]),  # independent
        ([(1, 2), (2, 3)], [(1, 2), (1, 3)]),  # a chain: 3 gets what 2 got, 1's content
        ([(1, 2), (2, 1)], [(1, 2)]),  # back again: 1 ends as it was
        ([(1, 2), (3, 2)], [(3, 2)]),  # the later copy to 2 wins
        ([(2, 3), (1, 2)], [(2, 3), (1, 2)]),  # 3 reads 2 before it is overwritten
        ([(4, 4)], []),
        ([], []),
    ],
)
def test_resolve_copies(pairs, resolved):
    assert sorted(resolve_copies(pairs)) == sorted(resolved)
    cache, ref = torch.arange(6.0)[:, None].repeat(1, 3), torch.arange(6.0)[:, None].repeat(1, 3)
    copy_blocks([(cache,)], pairs)
    sequential(ref, pairs)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("seed", range(20))
def test_copy_on_write_batched_matches_sequential_copies(seed):
    rng = random.Random(seed)
    pairs = [(rng.randrange(8), rng.randrange(8)) for _ in range(rng.randrange(1, 10))]
    layers = caches(8, quantized=seed % 2 == 1, seed=seed)
    expected = [tuple(t.clone() for t in layer) for layer in layers]
    copy_blocks(layers, pairs)
    for layer in expected:
        for t in layer:
            sequential(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t, pairs)
    assert same(layers, expected), pairs


@pytest.mark.triton
def test_triton_backend_with_swapping_is_token_identical_to_torch_backend(tiny_qwen2_dir):
    """A cache too small for the batch, a host pool that takes preempted requests: blocks go out
    and come back in through the swap path, the Triton kernels read them (Triton's interpreter on
    a CPU), and the output is the torch backend's."""
    pytest.importorskip("triton")
    from tokenmill import LLM, SamplingParams

    prompts = ["The quick brown fox jumps over the lazy dog. " * 2, "Hello there, how are you today?",
               "One two three four five six seven eight nine ten", "A B C D E F G H I J K L M N"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (14, 18, 10, 16)]
    kw = dict(dtype="float32", num_kv_blocks=10, block_size=8, max_num_batched_tokens=32, num_host_kv_blocks=12,
              enable_prefix_caching=False)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_qwen2_dir), attention_backend=backend, **kw)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        kv, scheduler = llm.engine.core.kv_cache_manager, llm.engine.core.scheduler
        assert scheduler.num_swap_preemptions > 0 and kv.num_swapped_out_blocks == kv.num_swapped_in_blocks > 0, backend
    assert outputs["triton"] == outputs["torch"]
