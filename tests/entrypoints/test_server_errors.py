"""Malformed and hostile requests against a real `tokenmill serve`: each one is answered with
the right 4xx status and an OpenAI-shaped error body naming the offending field, and the server
goes on serving (a small valid request right after it succeeds).

The two KV-cache cases depend on the shared server's flags (tests/serving.py:
--kv-cache-memory-gb 0.25 in fp32 is 364 blocks of 16 = 5824 tokens, under max_model_len 8192).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
MAX_BODY = 8 * 2**20  # --max-request-body-bytes default
CONTEXT = "maximum context length is 8192 tokens"
HI = [{"role": "user", "content": "Hi"}]
NO_PARAM = None  # errors about the request as a whole name no field


@dataclass
class Case:
    id: str
    method: str
    path: str
    status: int
    param: str | None
    json: object = None  # sent as JSON when `content` is None
    content: bytes | str | Callable | None = None  # raw body; a callable makes a fresh one (a stream)
    headers: dict = field(default_factory=dict)
    message: str | None = None  # a substring the error message must contain


def completion(id, status, param, message=None, **fields) -> Case:
    return Case(id, "POST", "/v1/completions", status, param,
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}, message=message)


def chat(id, status, param, message=None, **fields) -> Case:
    return Case(id, "POST", "/v1/chat/completions", status, param,
                json={"model": MODEL, "messages": HI, "max_tokens": 1, **fields}, message=message)


def raw(id, path, body: str, status, param, content_type="application/json", message=None) -> Case:
    return Case(id, "POST", path, status, param, content=body, headers={"content-type": content_type},
                message=message)


def raw_completion(id, fields: str, status, param, message=None) -> Case:
    """A completions body with `fields` spliced in as raw JSON text (NaN and Infinity are not JSON
    but Python's parser, and so the server's, takes them)."""
    return raw(id, "/v1/completions", f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 1, {fields}}}',
               status, param, message=message)


def _huge_body() -> bytes:
    return json.dumps({"model": MODEL, "prompt": "a" * (MAX_BODY + 1), "max_tokens": 1}).encode()


def _huge_body_chunked():
    """The same body with no Content-Length (chunked): the limit must hold as the body streams in."""
    body = _huge_body()
    return (body[i:i + 2**20] for i in range(0, len(body), 2**20))


CASES = [
    # -- wrong JSON types -------------------------------------------------------------------------
    completion("temperature-string", 400, "temperature", temperature="0.5"),
    completion("max_tokens-string", 400, "max_tokens", max_tokens="5"),
    completion("max_tokens-float", 400, "max_tokens", max_tokens=1.0),
    completion("n-bool", 400, "n", n=True),
    completion("stream-string", 400, "stream", stream="yes"),
    completion("seed-string", 400, "seed", seed="1"),
    completion("model-int", 400, "model", model=5),
    completion("prompt-dict", 400, "prompt", prompt={"text": "Hi"}),
    completion("prompt-mixed-list", 400, "prompt", prompt=["Hi", 5]),
    completion("stop-int", 400, "stop", stop=[1]),
    completion("logit_bias-list", 400, "logit_bias", logit_bias=[1]),
    completion("logit_bias-string-value", 400, "logit_bias", logit_bias={"5": "x"}),
    completion("stream_options-string", 400, "stream_options.include_usage", stream_options={"include_usage": "yes"}),
    chat("messages-string", 400, "messages", messages="Hi"),
    chat("messages-list-of-strings", 400, "messages.0", messages=["Hi"]),
    chat("content-list-of-ints", 400, "messages.0.content", messages=[{"role": "user", "content": [1]}]),
    chat("logprobs-int", 400, "logprobs", logprobs=1),
    # -- out of range --------------------------------------------------------------------------------
    completion("max_tokens-negative", 400, "max_tokens", max_tokens=-1),
    completion("max_tokens-zero", 400, "max_tokens", max_tokens=0),
    completion("max_tokens-1e9", 400, "max_tokens", CONTEXT, max_tokens=10**9),
    completion("max_tokens-1e30", 400, "max_tokens", CONTEXT, max_tokens=10**30),
    completion("n-zero", 400, "n", n=0),
    completion("n-1e6", 400, "n", n=10**6),
    completion("top_p-zero", 400, "top_p", top_p=0),
    completion("top_p-1.5", 400, "top_p", top_p=1.5),
    completion("temperature-negative", 400, "temperature", temperature=-1),
    completion("top_k-negative", 400, "top_k", top_k=-5),
    completion("min_p-2", 400, "min_p", min_p=2),
    completion("repetition_penalty-zero", 400, "repetition_penalty", repetition_penalty=0),
    completion("frequency_penalty-5", 400, "frequency_penalty", frequency_penalty=5),
    completion("presence_penalty-minus-3", 400, "presence_penalty", presence_penalty=-3),
    completion("logprobs-100", 400, "logprobs", logprobs=100),
    completion("logprobs-negative", 400, "logprobs", logprobs=-1),
    completion("min_tokens-over-max_tokens", 400, "min_tokens", min_tokens=5, max_tokens=2),
    completion("min_tokens-negative", 400, "min_tokens", min_tokens=-1),
    completion("stop_token_ids-negative", 400, "stop_token_ids", stop_token_ids=[-1]),
    chat("top_logprobs-50", 400, "top_logprobs", logprobs=True, top_logprobs=50),
    chat("top_logprobs-negative", 400, "top_logprobs", logprobs=True, top_logprobs=-1),
    chat("top_logprobs-without-logprobs", 400, "top_logprobs", top_logprobs=2),
    chat("max_tokens-1e9-chat", 400, "max_tokens", CONTEXT, max_tokens=10**9),
    chat("max_completion_tokens-zero", 400, "max_completion_tokens", max_completion_tokens=0),
    chat("max_completion_tokens-1e9", 400, "max_completion_tokens", CONTEXT, max_completion_tokens=10**9),
    # -- not finite (raw JSON text) --------------------------------------------------------------------
    raw_completion("temperature-NaN", '"temperature": NaN', 400, "temperature"),
    raw_completion("top_p-NaN", '"top_p": NaN', 400, "top_p"),
    raw_completion("top_p-Infinity", '"top_p": Infinity', 400, "top_p"),
    raw_completion("temperature-Infinity", '"temperature": Infinity', 400, "temperature"),
    raw_completion("presence_penalty-1e999", '"presence_penalty": 1e999', 400, "presence_penalty"),
    raw_completion("logit_bias--Infinity", '"logit_bias": {"5": -Infinity}', 400, "logit_bias"),
    raw_completion("logit_bias-NaN", '"logit_bias": {"5": NaN}', 400, "logit_bias"),
    # -- messages ------------------------------------------------------------------------------------
    chat("messages-empty", 400, "messages", messages=[]),
    chat("role-unknown", 400, "messages.0.role", messages=[{"role": "wizard", "content": "Hi"}]),
    chat("role-missing", 400, "messages.0.role", messages=[{"content": "Hi"}]),
    chat("role-unknown-second", 400, "messages.1.role",
         messages=[{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Hi"}]),
    chat("content-image-part", 400, "messages.0.content",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
    # -- prompts -------------------------------------------------------------------------------------
    completion("prompt-empty-string", 400, "prompt", prompt=""),
    completion("prompt-empty-list", 400, "prompt", prompt=[]),
    completion("prompt-empty-token-list", 400, "prompt", prompt=[[]]),
    completion("prompt-empty-string-in-batch", 400, "prompt", prompt=["Hi", ""]),
    completion("prompt-token-out-of-vocab", 400, "prompt", prompt=[1, 10**6]),
    completion("prompt-token-negative", 400, "prompt", prompt=[-1]),
    completion("prompt-token-huge-in-batch", 400, "prompt", prompt=[[1, 2], [10**30]]),
    completion("prompt-too-long", 400, "prompt", CONTEXT, prompt="word " * 9000),
    completion("prompt-too-long-stream", 400, "prompt", CONTEXT, prompt="word " * 9000, stream=True),
    chat("messages-too-long", 400, "messages", CONTEXT, messages=[{"role": "user", "content": "word " * 9000}]),
    # fits the context but never the KV cache: 400 before a stream starts, not a cut-off 200
    completion("prompt-over-kv-cache", 400, "prompt", prompt="word " * 6500, max_tokens=16),
    completion("prompt-over-kv-cache-stream", 400, "prompt", prompt="word " * 6500, max_tokens=16, stream=True),
    completion("max_tokens-over-kv-cache-stream", 400, "max_tokens", max_tokens=6000, stream=True),
    # -- the body itself -------------------------------------------------------------------------------
    raw("json-invalid", "/v1/completions", '{"model": "smollm2-135m", "prompt": ', 400, NO_PARAM, message="JSON"),
    raw("json-list", "/v1/completions", '[{"model": "smollm2-135m", "prompt": "Hi"}]', 400, NO_PARAM),
    raw("json-string", "/v1/chat/completions", '"Hi"', 400, NO_PARAM),
    raw("body-empty", "/v1/completions", "", 400, NO_PARAM),
    raw("content-type-text", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
        400, NO_PARAM, content_type="text/plain"),
    Case("prompt-missing", "POST", "/v1/completions", 400, "prompt", json={"model": MODEL}),
    Case("messages-missing", "POST", "/v1/chat/completions", 400, "messages", json={"model": MODEL}),
    Case("body-too-large", "POST", "/v1/completions", 413, NO_PARAM, content=_huge_body,
         headers={"content-type": "application/json"}),
    Case("body-too-large-chunked", "POST", "/v1/completions", 413, NO_PARAM, content=_huge_body_chunked,
         headers={"content-type": "application/json"}),
    # -- logit_bias ----------------------------------------------------------------------------------
    completion("logit_bias-key-abc", 400, "logit_bias", logit_bias={"abc": 1}),
    completion("logit_bias-key-negative", 400, "logit_bias", logit_bias={"-1": 1}),
    completion("logit_bias-key-out-of-vocab", 400, "logit_bias", logit_bias={"999999999": 1}),
    completion("logit_bias-value-500", 400, "logit_bias", logit_bias={"5": 500}),
    completion("logit_bias-value-minus-101", 400, "logit_bias", logit_bias={"5": -101}),
    # -- model, stop, unsupported fields ---------------------------------------------------------------
    completion("model-unknown", 404, "model", model="gpt-4"),
    chat("model-unknown-chat", 404, "model", model="gpt-4"),
    completion("stop-17-strings", 400, "stop", "16", stop=[f"s{i}" for i in range(17)]),
    completion("stop-empty-string", 400, "stop", stop=[""]),
    completion("stop-empty-string-alone", 400, "stop", stop=""),
    completion("stop-string-too-long", 400, "stop", stop=["x" * 2000]),
    completion("suffix", 400, "suffix", suffix="!"),
    completion("best_of", 400, "best_of", best_of=3),
    completion("n-zero-stream", 400, "n", n=0, stream=True),
    # -- routing -------------------------------------------------------------------------------------
    Case("endpoint-unknown", "POST", "/v1/nonexistent", 404, NO_PARAM, json={"model": MODEL}),
    Case("endpoint-unknown-get", "GET", "/v2/models", 404, NO_PARAM),
    Case("method-get-completions", "GET", "/v1/completions", 405, NO_PARAM),
    Case("method-delete-chat", "DELETE", "/v1/chat/completions", 405, NO_PARAM),
    # -- /tokenize and /detokenize -------------------------------------------------------------------
    Case("tokenize-neither", "POST", "/tokenize", 400, "prompt", json={}),
    Case("tokenize-both", "POST", "/tokenize", 400, "prompt", json={"prompt": "Hi", "messages": HI}),
    Case("tokenize-prompt-int", "POST", "/tokenize", 400, "prompt", json={"prompt": 5}),
    Case("tokenize-role-unknown", "POST", "/tokenize", 400, "messages.0.role",
         json={"messages": [{"role": "wizard", "content": "Hi"}]}),
    Case("tokenize-model-unknown", "POST", "/tokenize", 404, "model", json={"model": "gpt-4", "prompt": "Hi"}),
    raw("tokenize-json-invalid", "/tokenize", "{", 400, NO_PARAM),
    Case("detokenize-out-of-vocab", "POST", "/detokenize", 400, "tokens", json={"tokens": [1, 10**6]}),
    Case("detokenize-negative", "POST", "/detokenize", 400, "tokens", json={"tokens": [-1]}),
    Case("detokenize-huge", "POST", "/detokenize", 400, "tokens", json={"tokens": [10**30]}),
    Case("detokenize-strings", "POST", "/detokenize", 400, "tokens", json={"tokens": ["1"]}),
    Case("detokenize-not-a-list", "POST", "/detokenize", 400, "tokens", json={"tokens": "abc"}),
    Case("detokenize-missing", "POST", "/detokenize", 400, "tokens", json={}),
    Case("detokenize-model-unknown", "POST", "/detokenize", 404, "model", json={"model": "gpt-4", "tokens": [1]}),
]

assert len({c.id for c in CASES}) == len(CASES)


def assert_still_serving(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_is_answered_in_openai_shape(server, case: Case):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        if case.content is not None:
            content = case.content() if callable(case.content) else case.content
            r = client.request(case.method, case.path, content=content, headers=case.headers)
        elif case.json is not None:
            r = client.request(case.method, case.path, json=case.json, headers=case.headers)
        else:
            r = client.request(case.method, case.path, headers=case.headers)

        assert r.status_code == case.status, r.text[:500]
        assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
        body = r.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert {"message", "type", "param", "code"} <= set(error), error
        assert isinstance(error["message"], str) and error["message"].strip(), error
        assert isinstance(error["type"], str) and error["type"], error
        assert error["type"] != "server_error", error
        if case.status != 404:
            assert error["type"] == "invalid_request_error", error
        assert error["param"] == case.param, error
        if case.message is not None:
            assert case.message in error["message"], error

        assert_still_serving(client)


# Legal but extreme values: the engine must take them in its stride, not crash on them.
EXTREME_BUT_VALID = {
    "top_k-huge": {"top_k": 10**9, "temperature": 1.0},
    "seed-huge": {"seed": 10**30, "temperature": 1.0},
    "seed-negative": {"seed": -5, "temperature": 1.0},
    "temperature-huge": {"temperature": 1e300},
    "temperature-tiny": {"temperature": 1e-30},
    "repetition_penalty-huge": {"repetition_penalty": 1e300, "temperature": 1.0},
    "repetition_penalty-tiny": {"repetition_penalty": 1e-300, "temperature": 1.0},
    "logit_bias-extremes": {"logit_bias": {"0": 100, "1": -100}, "temperature": 1.0, "logprobs": 20},
    "stop_token_ids-huge": {"stop_token_ids": [10**30], "min_tokens": 1},
    "top_p-tiny": {"top_p": 1e-30, "temperature": 1.0},
}


@pytest.mark.parametrize("fields", list(EXTREME_BUT_VALID.values()), ids=list(EXTREME_BUT_VALID))
def test_extreme_but_valid_values_are_served(server, fields):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text[:500]
        (choice,) = r.json()["choices"]
        assert isinstance(choice["text"], str)
        assert_still_serving(client)
