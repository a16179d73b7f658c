"""The multiturn workload: chats that grow round by round over one shared system prompt."""

from __future__ import annotations

from tokenmill.bench.datasets import DatasetConfig, build_requests
from tests.bench.test_units import CharTokenizer


def test_rounds_grow_each_users_chat_and_a_replay_sends_the_same_prompts():
    cfg = DatasetConfig("multiturn", num_users=3, num_rounds=4, system_prompt_len=40, history_len=10, output_len="5")
    reqs = build_requests(cfg, CharTokenizer())
    assert len(reqs) == 12 and all(r.ignore_eos and r.max_tokens == 5 for r in reqs)
    assert len({r.messages[0]["content"] for r in reqs}) == 1  # one system prompt for everyone
    for i, r in enumerate(reqs):
        rnd, user = divmod(i, 3)  # round by round, users in rotation
        assert len(r.messages) == 2 + 2 * rnd and [m["role"] for m in r.messages[1::2]] == ["user"] * (rnd + 1)
        assert r.target_input_len == 40 + (rnd + 1) * 10 + rnd * 5
        if rnd:
            assert r.messages[:-2] == reqs[i - 3].messages  # the user's last round, continued
            assert r.messages[-2]["role"] == "assistant"
    replay = build_requests(DatasetConfig("multiturn", num_users=3, num_rounds=4, system_prompt_len=40, history_len=10,
                                          output_len="5", first_round=3), CharTokenizer())
    assert [r.messages for r in replay] == [r.messages for r in reqs[6:]]
