"""Prefix caching and swapping on the real default model: outputs never change, work does."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SYSTEM = ("You are a meticulous assistant for a library. Answer in one short sentence, cite no sources, and "
          "never invent facts. The library opens at nine and closes at six, and it is closed on Sundays. ") * 3
QUESTIONS = ["When does the library open?", "Is it open on Sunday?", "When does it close?", "Can I bring a dog?",
             "Do you have a cafe?", "How many books can I borrow?"]


def workload(llm: LLM) -> list[list[int]]:
    """A shared system prompt with distinct questions (submitted together), then multi-turn
    chats that extend earlier turns with the model's own replies."""
    first = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(first, GREEDY)
    second = [conv + [{"role": "assistant", "content": o.outputs[0].text}, {"role": "user", "content": "Why?"}]
              for conv, o in zip(first, outs)]
    outs2 = llm.chat(second, GREEDY)
    third = [conv + [{"role": "assistant", "content": o.outputs[0].text}, {"role": "user", "content": "Thanks."}]
             for conv, o in zip(second, outs2)]
    outs3 = llm.chat(third[:3], GREEDY)
    return [o.outputs[0].token_ids for o in outs + outs2 + outs3]


@pytest.fixture(scope="module")
def uncached(default_model_path):
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, enable_prefix_caching=False)
    return workload(llm)


def test_prefix_caching_changes_no_output(default_model_path, uncached):
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25)
    assert workload(llm) == uncached
    kv = llm.engine.core.kv_cache_manager
    # The system prompt (~100 tokens) is computed once for six questions, and later turns reuse
    # the earlier turns: most prompt tokens come from the cache.
    assert kv.prefix_hit_tokens > 0.5 * kv.prefix_query_tokens


def test_too_small_a_cache_swaps_and_recomputes_without_changing_output(default_model_path, uncached):
    # 14 blocks x 16 tokens cannot hold six ~160-token conversations at once; 12 host blocks hold
    # some of the preempted ones, the rest are recomputed.
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", num_kv_blocks=14, num_host_kv_blocks=12,
              max_num_batched_tokens=128)
    assert workload(llm) == uncached
    core = llm.engine.core
    assert core.scheduler.num_preemptions > core.scheduler.num_swap_preemptions > 0
    assert core.kv_cache_manager.num_swapped_out_blocks == core.kv_cache_manager.num_swapped_in_blocks > 0


def test_swap_round_trip_restores_block_contents(default_model_path):
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", num_kv_blocks=8, num_host_kv_blocks=4)
    runner = llm.engine.core.runner
    torch.manual_seed(0)
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k[[5, 2]].clone(), v[[5, 2]].clone()) for k, v in runner.kv_caches]
    runner._swap([(5, 3), (2, 0)], out=True)  # device 5 -> host 3, device 2 -> host 0
    for k, v in runner.kv_caches:
        k.zero_()
        v.zero_()
    runner._swap([(3, 6), (0, 1)], out=False)  # back into device blocks 6 and 1
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k[[6, 1]], k0) and torch.equal(v[[6, 1]], v0)
        assert not k[[0, 2, 3, 4, 5, 7]].any()


def test_n_samples_fork_the_prompt_and_sample_as_if_alone(default_model_path):
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, enable_prefix_caching=False)
    prompt = SYSTEM + "Question: when does the library open on Saturdays? Answer:"
    greedy = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert [c.token_ids for c in llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=16,
                                                                      ignore_eos=True))[0].outputs] == [greedy] * 3
    kv = llm.engine.core.kv_cache_manager
    prompt_blocks = -(-len(llm.tokenizer.encode(prompt)) // 16)
    assert kv.num_forked_blocks == 2 * prompt_blocks and kv.num_copied_blocks >= 2  # no prefix cache: forks
    # Sample i of a seeded request draws like a request alone with seed + i.
    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    together = [c.token_ids for c in llm.generate(prompt, seeded)[0].outputs]
    alone = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True))[0]
             .outputs[0].token_ids for i in range(3)]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1
