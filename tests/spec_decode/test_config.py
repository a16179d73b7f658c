"""Speculative-decoding config checks (no model needed)."""

import pytest

from tokenmill.config import ConfigError, EngineConfig


@pytest.mark.parametrize("kwargs, field", [
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(speculative_method="draft"), "draft_model"),
    (dict(draft_model="smollm2-135m"), "draft_model"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", speculative_ngram_min=3, speculative_ngram_max=2), "speculative_ngram_max"),
    (dict(speculative_max_running=0), "speculative_max_running"),
])
def test_bad_speculative_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert e.value.field == field


def test_good_settings():
    EngineConfig(speculative_method="draft", draft_model="smollm2-135m", num_speculative_tokens=6)
    EngineConfig(speculative_method="ngram", speculative_ngram_min=1, speculative_ngram_max=1)
    EngineConfig(speculative_method="suffix", num_speculative_tokens=8)
