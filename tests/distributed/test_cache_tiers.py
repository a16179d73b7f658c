"""The prefix cache's tiers with the model split over ranks: the host tier works per rank (each
rank demotes and promotes its own heads' or layers' blocks, by the same slots), greedy output
unchanged in fp32; the disk tier is refused before any rank starts, the error naming the flags."""

from __future__ import annotations

import pytest

from tests.engine.test_cache_tiers import ORDER, TIERED, expected, run  # noqa: F401 (expected: a fixture)
from tokenmill import LLM
from tokenmill.config import ConfigError

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_the_host_tier_works_per_rank_and_changes_no_output(default_model_path, expected, split):  # noqa: F811
    with LLM(str(default_model_path), **TIERED, **split) as llm:
        assert run(llm) == [expected[i] for i in ORDER]
        kv = llm.engine.core.kv_cache_manager
    assert kv.num_demoted_blocks > 0 and kv.host_hit_blocks > 0 and kv.num_promoted_blocks == kv.host_hit_blocks


def test_the_disk_tier_is_refused_split_over_ranks_naming_the_flags(default_model_path, tmp_path):
    for split in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ConfigError, match="--disk-cache-dir.*--tensor-parallel-size, --pipeline-parallel-size"):
            LLM(str(default_model_path), disk_cache_dir=str(tmp_path), **TIERED, **split)
    assert list(tmp_path.iterdir()) == []
