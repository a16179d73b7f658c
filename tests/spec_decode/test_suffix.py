"""The suffix-decoding proposer on hand-made token sequences and a store of finished outputs."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.spec_decode.suffix import SuffixProposer


def test_copies_what_followed_the_earlier_occurrence():
    assert SuffixProposer().propose("a", [1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert SuffixProposer().propose("a", [1, 1, 1, 1], 3) == [1]  # [1, 1, 1] last ended at 2
    assert SuffixProposer().propose("a", np.array([9, 4, 5, 6, 7, 4, 5]), 5) == [6, 7]


def test_no_proposal_without_a_match():
    proposer = SuffixProposer()
    assert proposer.propose("a", [5, 6, 7], 2) == []
    assert proposer.propose("b", [4], 3) == []
    assert proposer.propose("c", [], 3) == []
    assert proposer.propose_scored("d", [1, 2, 9, 3], 2) == ([], 0.0)


def test_k_of_zero_or_less_proposes_nothing():
    assert SuffixProposer().propose("a", [1, 2, 3, 1, 2], 0) == []
    assert SuffixProposer().propose("a", [1, 2, 3, 1, 2], -1) == []


def test_the_more_frequent_continuation_wins_over_the_more_recent():
    # [1, 2] occurred three times: followed by 3, 3 and (most recently) 4
    proposer = SuffixProposer(max_spec_factor=4)
    draft, score = proposer.propose_scored("a", [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], 3)
    assert draft == [3, 1, 2]
    assert score == pytest.approx(3 * 2 / 3)
    # a tie goes to the most recent continuation
    assert SuffixProposer().propose("a", [1, 2, 3, 1, 2, 4, 1, 2], 1) == [4]


def _store(outputs, **kwargs):
    proposer = SuffixProposer(**kwargs)
    for i, output in enumerate(outputs):
        proposer.finish(f"done-{i}", [99, 98] + output, num_prompt_tokens=2)
    return proposer


def test_the_draft_stops_where_its_probability_falls_under_min_token_prob():
    # after [5, 6]: 1 three times out of four; after [5, 6, 1]: 2 twice out of three; then 3 always
    outputs = [[5, 6, 1, 2, 3], [5, 6, 1, 2, 3], [5, 6, 1, 4, 3], [5, 6, 7]]
    context = [42, 5, 6]

    def scored(min_token_prob):
        return _store(outputs, max_spec_factor=4, min_token_prob=min_token_prob).propose_scored("a", context, 8)

    draft, score = scored(0.5)
    assert draft == [1, 2, 3]  # probabilities 0.75, 0.5, 0.5, then no stored token follows
    assert score == pytest.approx(0.75 + 0.5 + 0.5)
    assert scored(0.6) == ([1], pytest.approx(0.75))
    assert scored(0.8) == ([], 0.0)
    assert scored(1.0) == ([], 0.0)


def test_max_spec_factor_caps_the_draft_by_the_match_length_and_k_caps_it():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # matches [1, 2]: 2 tokens
    assert SuffixProposer(max_spec_factor=1.0).propose("a", context, 8) == [3, 4]
    assert SuffixProposer(max_spec_factor=2.0).propose("a", context, 8) == [3, 4, 5, 6]
    assert SuffixProposer(max_spec_factor=0.5).propose("a", context, 8) == [3]
    assert SuffixProposer(max_spec_factor=0.1).propose("a", context, 8) == [3]  # at least one token
    assert SuffixProposer(max_spec_factor=8.0).propose("a", context, 3) == [3, 4, 5]
    # the match itself is at most max_depth tokens long
    assert SuffixProposer(max_depth=1, max_spec_factor=2.0).propose("a", context, 8) == [3, 4]


def test_a_finished_output_is_proposed_to_a_later_request():
    tool_call = [500, 501, 502, 503, 504, 505, 506, 507, 508, 509, 510, 511, 512, 513, 514, 515, 516]
    output = tool_call + [2]
    proposer = SuffixProposer(max_spec_factor=4)
    proposer.propose("a", [7, 8, 9] + output[:3], 4)
    proposer.finish("a", [7, 8, 9] + output, num_prompt_tokens=3)
    assert proposer.memory_tokens() == len(output)
    # its own tokens never held the call, the store did
    context = [30, 31, 32, 33] + output[:4]
    assert SuffixProposer(max_spec_factor=4).propose("b", context, 16) == []
    assert proposer.propose_scored("b", context, 16) == (output[4:], pytest.approx(len(output) - 4))
    assert proposer.propose("c", context, 5) == output[4:9]
    assert proposer.propose("e", context, 5, use_store=False) == []  # (the request's own tokens only)
    # the prompt is not stored
    assert proposer.propose("d", [40, 7, 8], 4) == []


def test_drop_adds_nothing_to_the_store():
    proposer = SuffixProposer()
    proposer.propose("a", [1, 2, 3, 4, 5, 6], 4)
    proposer.drop("a")
    assert proposer.memory_tokens() == 0
    assert proposer.propose("b", [9, 3, 4], 4) == []
    proposer.drop("never-seen")


def test_the_better_scored_source_wins_and_ties_go_to_the_own_tokens():
    # own: [1, 2] was followed by 3, 1, 2 (score 3); stored: by 7, 7, 7, 7 (score 4)
    stored_longer = _store([[1, 2, 7, 7, 7, 7]], max_spec_factor=2)
    assert stored_longer.propose("a", [1, 2, 3, 1, 2], 4) == [7, 7, 7, 7]
    stored_as_long = _store([[1, 2, 7, 7, 7]], max_spec_factor=2)
    assert stored_as_long.propose("a", [1, 2, 3, 1, 2], 4) == [3, 1, 2]


def test_a_suffix_only_the_store_holds_at_full_length_beats_a_shorter_own_match():
    proposer = _store([[4, 5, 6, 7, 8, 9]])
    draft, score = proposer.propose_scored("a", [6, 1, 5, 6], 8)  # own: [6] -> 1; stored: [5, 6] -> 7, 8
    assert (draft, score) == ([7, 8], pytest.approx(2.0))


def test_the_store_keeps_the_newest_outputs_within_max_cached_tokens():
    num_requests, output_len, max_tokens = 10_000, 200, 100_000
    outputs = np.random.default_rng(0).integers(0, 1 << 20, size=(num_requests, output_len))
    proposer = SuffixProposer(max_spec_factor=1.0, max_cached_requests=num_requests, max_cached_tokens=max_tokens)
    for i, output in enumerate(outputs):
        proposer.finish(f"r{i}", output, num_prompt_tokens=0)
        assert proposer.memory_tokens() <= max_tokens
    assert proposer.memory_tokens() == max_tokens
    num_kept = max_tokens // output_len

    def proposed(i):
        return proposer.propose(f"q{i}", outputs[i][:16], 16)

    for i in (num_requests - 1, num_requests - num_kept):  # the newest and the oldest kept
        assert proposed(i) == outputs[i][16:32].tolist()
    for i in (0, num_requests // 2, num_requests - num_kept - 1):  # evicted (at most a 1-token chance match)
        assert len(proposed(i)) <= 1


def test_the_store_keeps_at_most_max_cached_requests_outputs():
    outputs = [[100 * i + j for j in range(10)] for i in range(5)]
    proposer = _store(outputs, max_cached_requests=3)
    assert proposer.memory_tokens() == 30
    assert [len(proposer.propose(f"q{i}", output[:3], 7)) for i, output in enumerate(outputs)] == [0, 0, 3, 3, 3]
    # an output longer than the whole store keeps its last tokens
    proposer = _store([list(range(100, 120))], max_cached_tokens=8)
    assert proposer.memory_tokens() == 8
    assert proposer.propose("a", [112, 113], 2) == [114, 115]
    assert proposer.propose("b", [102, 103], 2) == []
    assert _store(outputs, max_cached_requests=0).memory_tokens() == 0
    assert _store(outputs, max_cached_tokens=0).memory_tokens() == 0


def test_the_store_survives_many_rebuilds_of_its_buffer():
    # Outputs of varied length cycle through a small store. Every kept output stays findable, and
    # the continuations of a marker that recurs across them are counted over all kept outputs.
    rng = np.random.default_rng(1)
    marker = [10, 11, 12, 13]
    proposer = SuffixProposer(max_spec_factor=1.0, max_cached_requests=50, max_cached_tokens=3_000)
    kept = []
    for i in range(2_000):
        output = rng.integers(1_000, 1 << 20, size=int(rng.integers(20, 200))).tolist()
        if i % 3 == 0:
            output[5:10] = marker + [2 if i % 12 == 0 else 1]  # three 1s to each 2
        proposer.finish(f"r{i}", output, num_prompt_tokens=0)
        kept = (kept + [output])[-50:]
        while sum(map(len, kept)) > 3_000:
            kept.pop(0)
        assert proposer.memory_tokens() == sum(map(len, kept))
        if i % 7 == 0:
            counts = {1: 0, 2: 0}
            for stored in kept:
                if stored[5:9] == marker:
                    counts[stored[9]] += 1
            assert counts[1] != counts[2]
            best = max(counts, key=counts.get)
            draft, score = proposer.propose_scored(f"m{i}", [5] + marker, 1)
            assert (draft, score) == ([best], pytest.approx(counts[best] / sum(counts.values())))
    for j, output in enumerate(kept):
        assert proposer.propose(f"q{j}", output[:5], 5) == output[5:10]
        assert proposer.propose(f"q{j}", output[:20], 10) == output[20:30]


def test_growing_context_gives_the_same_drafts_as_a_fresh_request():
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 6, size=3_000).tolist()  # a small vocabulary: many matches of all lengths
    outputs = [rng.integers(0, 6, size=100).tolist() for _ in range(20)]
    incremental = _store(outputs, max_spec_factor=2.0, min_token_prob=0.05)
    reference = _store(outputs, max_spec_factor=2.0, min_token_prob=0.05)
    length = 1
    while length < len(tokens):
        k = int(rng.integers(1, 8))
        expected = reference.propose_scored(f"x{length}", tokens[:length], k)
        reference.drop(f"x{length}")
        assert incremental.propose_scored("a", tokens[:length], k) == expected
        length += int(rng.integers(1, k + 2))
    # a req_id reused with tokens that do not extend the last ones starts afresh
    other = rng.integers(0, 6, size=500).tolist()
    assert incremental.propose_scored("a", other, 5) == reference.propose_scored("y", other, 5)


def test_a_req_id_whose_tokens_do_not_extend_the_last_ones_starts_afresh():
    proposer = SuffixProposer()
    assert proposer.propose("a", [1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert proposer.propose("a", [5, 6, 7, 8, 5, 6, 9, 5], 2) == [6]  # longer, another 6th token
    assert proposer.propose("a", [3, 4, 3], 2) == [4]  # shorter


@pytest.mark.parametrize("kwargs, name", [
    ({"max_depth": 0}, "max_depth"),
    ({"max_spec_factor": 0}, "max_spec_factor"),
    ({"max_spec_factor": -1.0}, "max_spec_factor"),
    ({"min_token_prob": 0}, "min_token_prob"),
    ({"min_token_prob": 1.5}, "min_token_prob"),
    ({"max_cached_requests": -1}, "max_cached_requests"),
    ({"max_cached_tokens": -1}, "max_cached_tokens"),
    ({"max_occurrences": 0}, "max_occurrences"),
])
def test_bad_parameters_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SuffixProposer(**kwargs)
