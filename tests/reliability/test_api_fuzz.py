"""The HTTP API under schemathesis (scripts/fuzz_api.py, CI-sized): every operation of the served
/openapi.json, positive and negative modes, examples + coverage + fuzzing phases, against one
real `tokenmill serve` on 127.0.0.1. Bounded by examples per operation (not time). It passes
when no response is a 5xx (nor an error event inside a 200 stream), every request is answered
within its timeout, /health answers 200 afterwards and the same server process still runs.
`python scripts/fuzz_api.py` runs the same for as long as it is given.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.scripts import load_script
from tests.serving import MODEL, ServerProcess

MAX_EXAMPLES = 5  # per operation and mode: ~1,100 requests, most from the coverage phase
SEED = 20240601
GENERATING = ("POST /v1/completions", "POST /v1/chat/completions")
fuzz_api = load_script("fuzz_api")


@pytest.mark.slow
def test_fuzzed_api_never_answers_5xx_nor_hangs(default_model_path, tmp_path):
    server = ServerProcess(MODEL, *fuzz_api.server_flags(), log_path=tmp_path / "server.log").wait_ready()
    try:
        operations = {f"{method.upper()} {path}" for path, methods in
                      httpx.get(f"{server.url}/openapi.json").json()["paths"].items() for method in methods}
        summary = fuzz_api.fuzz(server.url, tmp_path, max_examples=MAX_EXAMPLES, seed=SEED, workers=2,
                                request_timeout=60, server_alive=lambda: server.proc.poll() is None)
        pid = server.proc.pid
    finally:
        returncode = server.stop()
    failures = {k: summary[k] for k in ("server_errors", "stream_errors", "no_answer")}
    assert summary["num_server_errors"] == 0, json.dumps(failures, indent=1)[:20000]
    assert summary["num_stream_errors"] == 0, json.dumps(failures, indent=1)[:20000]
    assert summary["num_no_answer"] == 0, json.dumps(failures, indent=1)[:20000]
    assert summary["health_after"] == 200 and summary["server_alive_after"] is True, summary
    assert summary["passed"]
    assert returncode == 0 and server.proc.pid == pid, server.log_path.read_text()[-3000:]

    # the run reached what it is meant to: every operation, both modes, the engine itself
    assert operations <= set(summary["by_operation"]), sorted(operations - set(summary["by_operation"]))
    modes = {key.split("/")[1] for key in summary["by_phase_mode"]}
    assert modes == {"positive", "negative"}, summary["by_phase_mode"]
    for op in GENERATING:
        assert summary["by_operation"][op].get("200", 0) >= 20, summary["by_operation"][op]
        assert summary["by_operation"][op].get("400", 0) >= 20, summary["by_operation"][op]


def test_summary_counts_and_fails_on_5xx_and_unanswered():
    """The summary is what the pass criteria read: a 5xx, an error event in a stream or an
    unanswered request each fail the run and are listed with their request."""
    request = {"method": "POST", "path": "/v1/completions", "body": "{}"}
    ok = {"operation": "POST /v1/completions", "phase": "fuzzing", "mode": "positive", "status": 200, "elapsed": 0.1}
    records = [ok, {**ok, "status": 400, "mode": "negative"},
               {**ok, "status": 500, "request": request},
               {**ok, "stream_error": 'data: {"error": {"type": "server_error"}}', "request": request},
               {**ok, "status": None, "no_answer": True, "request": request},
               {**ok, "elapsed": 3.0, "request": request}]
    summary = fuzz_api.summarize(records)
    assert summary["requests"] == 6
    assert summary["by_status"] == {"200": 3, "400": 1, "500": 1, "no answer": 1}
    assert summary["by_phase_mode"] == {"fuzzing/negative": {"400": 1},
                                        "fuzzing/positive": {"200": 3, "500": 1, "no answer": 1}}
    assert (summary["num_server_errors"], summary["num_stream_errors"], summary["num_no_answer"]) == (1, 1, 1)
    assert summary["server_errors"][0]["request"] == request
    assert [r["elapsed"] for r in summary["slowest"]] == [3.0]


def test_hooks_keep_generation_short():
    hooks = load_script("fuzz_hooks")
    body = {"max_tokens": 10**6, "n": 50, "min_tokens": 99, "prompt": ["a"] * 100}
    hooks._clip(body)
    assert body == {"max_tokens": hooks.MAX_TOKENS, "n": hooks.MAX_N, "min_tokens": hooks.MAX_TOKENS,
                    "prompt": ["a"] * hooks.MAX_PROMPTS}
    chat = {"messages": [], "max_completion_tokens": 2, "n": "x"}  # wrong types stay as drawn
    hooks._clip(chat)
    assert chat == {"messages": [], "max_completion_tokens": 2, "n": "x"}
    for chat in ({"messages": []}, {"messages": [], "max_completion_tokens": None}):
        hooks._clip(chat)
        assert chat["max_tokens"] == hooks.MAX_TOKENS  # chat's default (null: not sent) is the whole context
