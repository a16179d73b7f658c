"""The n-gram (prompt lookup) proposer on hand-made token sequences."""

from __future__ import annotations

import pytest

from tokenmill.spec_decode.ngram import NgramProposer


def test_copies_what_followed_the_earlier_occurrence():
    assert NgramProposer(1, 3).propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]


def test_most_recent_of_the_longest_match_wins():
    # suffix [2, 3] occurs at 1-2 (then 9) and at 4-5 (then 7, 8): the more recent one wins
    assert NgramProposer(1, 3).propose([1, 2, 3, 9, 2, 3, 7, 8, 2, 3], 2) == [7, 8]
    # the 3-gram [5, 2, 3] occurs only once earlier (followed by 6), the 2-gram [2, 3] later (then 7)
    assert NgramProposer(1, 3).propose([5, 2, 3, 6, 2, 3, 7, 5, 2, 3], 1) == [6]


def test_no_proposal_without_a_match_of_min_n():
    assert NgramProposer(1, 3).propose([5, 6, 7], 2) == []
    assert NgramProposer(2, 3).propose([1, 2, 9, 2], 2) == []  # only a 1-gram matches
    assert NgramProposer(2, 3).propose([1, 2, 9, 1, 2], 2) == [9, 1]


def test_proposal_is_cut_at_the_end_of_the_sequence_and_at_k():
    assert NgramProposer(1, 3).propose([1, 1, 1, 1], 3) == [1]  # [1,1,1] last seen ending at 2
    assert NgramProposer(1, 2).propose([4, 5, 6, 7, 8, 4, 5], 2) == [6, 7]
    assert NgramProposer(1, 2).propose([4, 5, 6, 7, 8, 4, 5], 0) == []
    assert NgramProposer(1, 2).propose([4], 3) == []


def test_bad_range_is_refused():
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
