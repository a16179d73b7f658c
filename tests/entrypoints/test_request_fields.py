"""Every request field is acted on, refused with a 400 naming it, or (harmless to ignore) accepted
and listed as ignored; unknown fields are a 400 naming them; invalid Unicode in any text is a 400
naming the field. Against a real `tokenmill serve`, with httpx and the `openai` client."""

from __future__ import annotations

import inspect
import json

import httpx
import openai
import pytest

from tokenmill.entrypoints.openai.protocol import (
    IGNORED_FIELDS,
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)

MODEL = "smollm2-135m"
HI = [{"role": "user", "content": "Hi"}]
BAD = "a\ud800b"  # a lone surrogate: valid JSON (as the escape \ud800), not valid Unicode text


def _client_fields(method) -> set[str]:
    return {p for p in inspect.signature(method).parameters
            if p not in {"self", "extra_headers", "extra_query", "extra_body", "timeout"}}


@pytest.mark.parametrize("endpoint, model, method", [
    ("chat", ChatCompletionRequest, openai.resources.chat.Completions.create),
    ("completions", CompletionRequest, openai.resources.Completions.create),
])
def test_every_openai_client_field_is_decided(endpoint, model, method):
    """Each parameter the installed `openai` client can send is declared (acted on or ignored) or
    refused with a reason; a new client field fails here until it is decided."""
    undecided = _client_fields(method) - set(model.model_fields) - set(REFUSED_FIELDS)
    assert not undecided, f"{endpoint}: no decision for {sorted(undecided)}"
    assert not set(model.model_fields) & set(REFUSED_FIELDS)


# -- against a server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _post(http, path, body):
    # json.dumps escapes non-ASCII (a lone surrogate as \ud800), as clients in other languages send it
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()


def _assert_400(http, path, body, param, message=None):
    status, answer = _post(http, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if message is not None:
        assert message in error["message"], error
    return error


def completion(**fields):
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": HI, "max_tokens": 1, **fields}


UNICODE_CASES = [
    ("/v1/completions", completion(prompt=BAD), "prompt"),
    ("/v1/completions", completion(prompt=["ok", BAD]), "prompt.1"),
    ("/v1/completions", completion(stop=["ok", BAD]), "stop.1"),
    ("/v1/completions", completion(stop=BAD), "stop"),
    ("/v1/completions", completion(model=BAD), "model"),
    ("/v1/completions", completion(user=BAD), "user"),
    ("/v1/completions", completion(logit_bias={BAD: 1}), "logit_bias"),
    ("/v1/completions", completion(suffix=BAD), "suffix"),
    ("/v1/completions", completion(guided_regex=BAD), "guided_regex"),
    ("/v1/completions", completion(guided_choice=["a", BAD]), "guided_choice.1"),
    ("/v1/completions", completion(unknown_field=BAD), "unknown_field"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": BAD}]), "messages.0.content"),
    ("/v1/chat/completions", chat(messages=[*HI, {"role": "assistant", "content": [{"type": "text", "text": BAD}]}]),
     "messages.1.content.0.text"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "Hi", "name": BAD}]), "messages.0.name"),
    ("/v1/chat/completions", chat(metadata={"k": BAD}), "metadata.k"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": BAD}}),
     "response_format.json_schema.name"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "description": BAD}}]),
     "tools.0.function.description"),
    ("/v1/chat/completions", chat(stop=[BAD]), "stop.0"),
    ("/tokenize", {"prompt": BAD}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BAD}]}, "messages.0.content"),
    ("/detokenize", {"tokens": [1], "model": BAD}, "model"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, param", UNICODE_CASES, ids=[c[2] + "@" + c[0] for c in UNICODE_CASES])
def test_invalid_unicode_is_a_400_naming_the_field(http, path, body, param):
    error = _assert_400(http, path, body, param, "invalid Unicode")
    assert "\\ud800" in error["message"]  # shown escaped


@pytest.mark.slow
def test_invalid_utf8_bytes_are_a_400(http):
    r = http.post("/v1/completions", content=b'{"model": "smollm2-135m", "prompt": "a\xff", "max_tokens": 1}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


UNKNOWN_CASES = [
    ("/v1/completions", completion(top_logprobs=2), "top_logprobs"),
    ("/v1/completions", completion(add_special_tokens=False), "add_special_tokens"),
    ("/v1/completions", completion(temprature=0.5), "temprature"),
    ("/v1/chat/completions", chat(echo=True), "echo"),
    ("/v1/chat/completions", chat(chat_template_kwargs={}), "chat_template_kwargs"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "Hi", "weight": 1}]), "messages.0.weight"),
    ("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True, "chunk_size": 2}),
     "stream_options.chunk_size"),
    ("/tokenize", {"prompt": "Hi", "return_token_strs": True}, "return_token_strs"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, param", UNKNOWN_CASES, ids=[c[2] for c in UNKNOWN_CASES])
def test_unknown_field_is_a_400_naming_it(http, path, body, param):
    _assert_400(http, path, body, param, "unknown field")


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
def test_refused_field_is_a_400_with_the_reason(http, field):
    value = {"audio": {"voice": "alloy", "format": "wav"}, "functions": [{"name": "f", "parameters": {}}],
             "function_call": "auto", "prediction": {"type": "content", "content": "x"}}.get(field, "x")
    _assert_400(http, "/v1/chat/completions", chat(**{field: value}), field, REFUSED_FIELDS[field])
    _assert_400(http, "/v1/completions", completion(**{field: value}), field, REFUSED_FIELDS[field])


VALUE_CASES = [
    ("/v1/completions", completion(suffix="!"), "suffix", "suffix"),
    ("/v1/completions", completion(best_of=2), "best_of", "use n"),
    ("/v1/completions", completion(stream_options={"include_usage": True}), "stream_options", "stream"),
    ("/v1/chat/completions", chat(store=True), "store", "stores no completions"),
    ("/v1/chat/completions", chat(modalities=["text", "audio"]), "modalities", "text"),
    ("/v1/chat/completions", chat(tool_choice="none"), "tool_choice", "tools"),
    ("/v1/chat/completions", chat(parallel_tool_calls=False), "parallel_tool_calls", "tools"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, param, message", VALUE_CASES, ids=[c[2] for c in VALUE_CASES])
def test_unsupported_value_is_a_400_naming_the_field(http, path, body, param, message):
    _assert_400(http, path, body, param, message)


IGNORED_VALUES = {
    "user": "user-1234", "guided_decoding_backend": "xgrammar", "metadata": {"project": "x"},
    "service_tier": "auto", "safety_identifier": "hash", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {}, "stream_options.include_obfuscation": True,
}


@pytest.mark.slow
def test_ignored_fields_change_nothing(http):
    """Each ignored field, with a value, gives the same greedy answer as the request without it;
    so do accepted values of refused-in-general fields, and null for any field."""
    assert set(IGNORED_VALUES) == IGNORED_FIELDS
    base = chat(max_tokens=6, temperature=0, messages=[{"role": "user", "content": "Name a color."}])
    status, expected = _post(http, "/v1/chat/completions", base)
    assert status == 200, expected
    same = {**{k: v for k, v in IGNORED_VALUES.items() if "." not in k},
            "store": False, "modalities": ["text"], "response_format": {"type": "text"}, "audio": None,
            "functions": None, "something_unknown": None, "suffix": None}
    for field, value in same.items():
        status, answer = _post(http, "/v1/chat/completions", {**base, field: value})
        assert status == 200, (field, answer)
        assert answer["choices"][0]["message"] == expected["choices"][0]["message"], field
    r = http.post("/v1/chat/completions", json={**base, "stream": True,
                                                "stream_options": {"include_usage": True, "include_obfuscation": True}})
    assert r.status_code == 200 and "data: [DONE]" in r.text
    for field in ("user", "suffix", "best_of"):
        value = {"user": "u", "suffix": "", "best_of": 1}[field]
        status, answer = _post(http, "/v1/completions", completion(**{field: value}))
        assert status == 200, (field, answer)
