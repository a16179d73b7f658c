"""`tokenmill eval`: the perplexity command on the real default model, and errors that must come
before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.eval.perplexity import gpl3_perplexity, gpl3_token_ids


def test_gpl3_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="GPL-3 perplexity"):
        gpl3_token_ids(None, path=tmp_path / "GPL-3")


def test_gsm8k_sample_too_large_fails_before_loading_the_model(capsys):
    assert main(["eval", "gsm8k", "--num-problems", "2000", "no-such-model"]) == 2
    assert "num_problems must be in [1, 1315], got 2000" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-windows", "--window"])
def test_ppl_rejects_non_positive_sizes(flag, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "ppl", flag, "0"])
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_ppl_writes_a_plausible_perplexity(default_model_path: Path, default_llm, tmp_path, capsys):
    output = tmp_path / "ppl.json"
    flags = ["--max-windows", "2", "--kv-cache-memory-gb", "0.25"]
    assert main(["eval", "ppl", *flags, "--output", str(output), str(default_model_path)]) == 0
    report = json.loads(output.read_text())
    assert (report["task"], report["window"], report["num_windows"]) == ("ppl", 512, 2)
    assert report["engine_config"]["model"] == str(default_model_path)
    assert 5 < report["perplexity"] < 60  # the whole of GPL-3 measures 18.1 (bf16 and fp32)
    assert f"GPL-3 perplexity {report['perplexity']:.4f} (2 windows" in capsys.readouterr().out

    # the library function the quantize report calls gives the same number for the same engine config
    assert gpl3_perplexity(default_llm, max_windows=2) == pytest.approx(report["perplexity"], rel=1e-6)
