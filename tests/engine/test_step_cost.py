"""The verify-cost model on the real model: the engine measures the step cost at start and caches
it, and the plan it makes from it decides who speculates: nobody where drafts cannot pay, requests
in a batch where they can. Outputs stay those of the engine without speculation."""

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.draft_plan import StepCost
from tokenmill.spec_decode import cost as cost_module
from tokenmill.spec_decode.cost import StepCostCache

ENGINE = dict(dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, speculative_ngram_min=1, speculative_ngram_max=3)
# prompts whose continuations repeat what they hold: n-gram drafts get accepted
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "List of prime numbers: 2, 3, 5, 7, 11,",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid",
    "a b c d e f g h a b c d e f g h a b c",
] * 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(default_model_path):
    with LLM(str(default_model_path), **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_the_step_cost_is_measured_once_and_cached(default_model_path, tmp_path, monkeypatch):
    monkeypatch.setattr(cost_module, "CACHE_DIR", tmp_path)
    with LLM(str(default_model_path), **ENGINE, **SPEC) as llm:
        measured = llm.engine.core.scheduler.config.step_cost
    assert measured.sizes[0] == 1 and 5 in measured.sizes  # one known token + the 4 drafts
    # and B requests decoding, as many as 256 batched tokens take with 64 in each cache
    assert measured.decode_sizes == (1, 2, 4) and min(measured.decode_seconds) > 0
    assert min(measured.seconds) > 0 and measured.time(32) > measured.time(1)  # (the fastest of 3 runs each)
    assert len(list(tmp_path.glob("*.json"))) == 1

    def measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr("tokenmill.engine.engine_core.measure_step_cost", measure)
    with LLM(str(default_model_path), **ENGINE, **SPEC) as llm:
        assert llm.engine.core.scheduler.config.step_cost == measured
    with pytest.raises(AssertionError, match="measured again"):  # another setup is another key
        LLM(str(default_model_path), **(ENGINE | {"kv_cache_dtype": "int8"}), **SPEC)


@pytest.mark.parametrize("curve, speculates", [
    (StepCost((1, 64), (1.0, 2.26)), True),  # bandwidth-bound: each drafted token costs 2% of a step
    (StepCost((1, 2), (1.0, 3.0)), False),  # a drafted token doubles the step: never pays
], ids=["flat", "steep"])
def test_the_plan_decides_who_speculates_and_outputs_do_not_change(default_model_path, reference, monkeypatch,
                                                                    curve, speculates):
    monkeypatch.setattr(StepCostCache, "get", lambda self, key: curve)
    with LLM(str(default_model_path), **ENGINE, **SPEC) as llm:
        outs = llm.generate(PROMPTS, GREEDY)  # 8 requests in one batch
        sched = llm.engine.core.scheduler
        assert [o.outputs[0].token_ids for o in outs] == reference
        if speculates:
            assert sched.num_spec_drafts > len(PROMPTS) and sched.num_spec_accepted_tokens > 0
        else:
            assert sched.num_spec_drafts == 0


def test_drafts_stop_as_the_batch_turns_compute_bound(default_model_path, reference, monkeypatch):
    """A step time growing faster than its tokens beyond 4 (compute-bound from there): one request
    alone speculates, eight at once do not."""
    monkeypatch.setattr(StepCostCache, "get", lambda self, key: StepCost((1, 4, 64), (1.0, 1.06, 18.0)))
    with LLM(str(default_model_path), **ENGINE, **SPEC) as llm:
        sched = llm.engine.core.scheduler
        alone = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
        assert alone.token_ids == reference[0] and alone.num_draft_tokens > 0
        drafts = sched.num_spec_drafts
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        # only as the batch drains (requests of equal length finish together) could a step afford drafts
        assert sched.num_spec_drafts == drafts
