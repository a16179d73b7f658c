"""Every limit on what one request may carry, against a real `tokenmill serve` on 127.0.0.1: at
the limit the request is served, one past it is refused with its status (400, 413 or 431) and an
OpenAI-shaped error body that names the limit (and the field, where there is one); the server
goes on serving. Header limits are exercised with raw sockets, so the head is exactly what is
counted. Invalid Unicode in the body, as bytes or as JSON escapes, is a 400.

Most cases run against a server started with small limits (`limited`); the defaults are checked
against the shared server.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.serving import BASE_FLAGS, MODEL, ServerProcess
from tokenmill.entrypoints.openai.args import PROMPT_CHARS_PER_TOKEN, ServerConfig
from tokenmill.entrypoints.openai.protocol import (
    MAX_N,
    MAX_SEQUENCES_PER_REQUEST,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
)
from tokenmill.sampling_params import MAX_LOGPROBS

pytestmark = pytest.mark.slow

MAX_HEADER_BYTES = 2048
MAX_HEADER_COUNT = 12
MAX_PROMPT_CHARS = 300
MAX_BODY_BYTES = 32 * 1024
LIMIT_FLAGS = ["--max-header-bytes", str(MAX_HEADER_BYTES), "--max-header-count", str(MAX_HEADER_COUNT),
               "--max-prompt-chars", str(MAX_PROMPT_CHARS), "--max-request-body-bytes", str(MAX_BODY_BYTES)]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def limited(default_model_path, tmp_path_factory):
    proc = ServerProcess(MODEL, *BASE_FLAGS, *LIMIT_FLAGS, log_path=tmp_path_factory.mktemp("limited") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def http(limited):
    with httpx.Client(base_url=limited.url, timeout=60) as client:
        yield client


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == status, error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error)
    return error


def assert_served(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 1, **fields}


# -- headers: raw HTTP/1.1 over a socket -----------------------------------------------------------


def raw_exchange(url: str, head: bytes, pieces: int = 1, timeout: float = 30) -> tuple[int, dict]:
    """Send `head` (request line and header lines, without the blank line that ends it) in
    `pieces` writes; return the status and the JSON body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        data = head + b"\r\n"
        step = -(-len(data) // pieces)
        try:
            for i in range(0, len(data), step):
                sock.sendall(data[i:i + step])
                if pieces > 1:
                    time.sleep(0.01)  # separate reads, so the parser sees an incomplete head
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the rest arrived
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < _expected_length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(body) if body.strip() else {}


def _expected_length(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return 0


def head_with(num_headers: int, size: int | None = None) -> bytes:
    """`GET /health` with `num_headers` header lines (Host first), padded by the last one to
    `size` bytes of request line and header lines (each line with its CRLF) when given."""
    lines = [b"GET /health HTTP/1.1", b"Host: x"] + [b"X-%d: y" % i for i in range(num_headers - 1)]
    head = b"".join(line + b"\r\n" for line in lines)
    if size is not None:
        assert size >= len(head) and num_headers >= 2
        head = head[:-2] + b"y" * (size - len(head)) + b"\r\n"
        assert len(head) == size
    return head


def test_header_count_limit(limited):
    status, body = raw_exchange(limited.url, head_with(MAX_HEADER_COUNT))
    assert status == 200, body
    status, body = raw_exchange(limited.url, head_with(MAX_HEADER_COUNT + 1))
    assert status == 431, body
    assert body["error"]["code"] == 431 and body["error"]["type"] == "invalid_request_error", body
    assert f"{MAX_HEADER_COUNT + 1} headers" in body["error"]["message"], body
    assert f"at most {MAX_HEADER_COUNT}" in body["error"]["message"], body


def test_header_bytes_limit(limited):
    status, body = raw_exchange(limited.url, head_with(4, size=MAX_HEADER_BYTES))
    assert status == 200, body
    status, body = raw_exchange(limited.url, head_with(4, size=MAX_HEADER_BYTES + 1))
    assert status == 431, body
    assert f"{MAX_HEADER_BYTES + 1} bytes" in body["error"]["message"], body
    assert f"at most {MAX_HEADER_BYTES}" in body["error"]["message"], body


def test_header_far_over_the_limit_sent_slowly_is_a_431(limited, http):
    """A head the HTTP parser gives up on before it is complete gets the same JSON 431."""
    status, body = raw_exchange(limited.url, head_with(4, size=20 * MAX_HEADER_BYTES), pieces=40)
    assert status == 431, body
    assert body["error"]["code"] == 431 and str(MAX_HEADER_BYTES) in body["error"]["message"], body
    assert_served(http)


def test_a_request_that_is_not_http_is_a_json_400(limited, http):
    status, body = raw_exchange(limited.url, b"HELLO THERE\r\n")
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400, body
    assert_served(http)


def test_default_header_limits(server):
    config = ServerConfig()
    status, body = raw_exchange(server.url, head_with(config.max_header_count))
    assert status == 200, body
    status, body = raw_exchange(server.url, head_with(config.max_header_count + 1))
    assert status == 431, body
    status, body = raw_exchange(server.url, head_with(4, size=config.max_header_bytes))
    assert status == 200, body
    status, body = raw_exchange(server.url, head_with(4, size=config.max_header_bytes + 1))
    assert status == 431, body


# -- the body ----------------------------------------------------------------------------------------


def test_body_size_limit(http):
    def body_of(size: int) -> bytes:
        base = json.dumps(completion(user=""))
        return base.replace('"user": ""', '"user": "' + "u" * (size - len(base)) + '"').encode()

    assert len(body_of(MAX_BODY_BYTES)) == MAX_BODY_BYTES
    r = http.post("/v1/completions", content=body_of(MAX_BODY_BYTES), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", content=body_of(MAX_BODY_BYTES + 1), headers={"content-type": "application/json"})
    assert_error(r, 413, None, str(MAX_BODY_BYTES))
    assert_served(http)


# -- the prompt ----------------------------------------------------------------------------------


def test_prompt_length_limit(http):
    r = http.post("/v1/completions", json=completion(prompt="a" * MAX_PROMPT_CHARS))
    assert r.status_code == 200, r.text
    over = "a" * (MAX_PROMPT_CHARS + 1)
    r = http.post("/v1/completions", json=completion(prompt=over))
    assert_error(r, 400, "prompt", f"{MAX_PROMPT_CHARS + 1} characters", f"at most {MAX_PROMPT_CHARS}")
    r = http.post("/v1/completions", json=completion(prompt=["Hi", over]))
    assert_error(r, 400, "prompt.1", f"at most {MAX_PROMPT_CHARS}")
    r = http.post("/tokenize", json={"prompt": over})
    assert_error(r, 400, "prompt", f"at most {MAX_PROMPT_CHARS}")
    # a chat is measured as the template renders it, with its role markers
    r = http.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "a" * MAX_PROMPT_CHARS}]))
    assert_error(r, 400, "messages", f"at most {MAX_PROMPT_CHARS}")
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "a" * MAX_PROMPT_CHARS}]})
    assert_error(r, 400, "messages", f"at most {MAX_PROMPT_CHARS}")
    r = http.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "a" * 100}]))
    assert r.status_code == 200, r.text


def test_default_prompt_length_limit(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
        limit = PROMPT_CHARS_PER_TOKEN * max_model_len
        r = http.post("/tokenize", json={"prompt": "a" * (limit + 1)})
        assert_error(r, 400, "prompt", f"at most {limit}")
        r = http.post("/tokenize", json={"prompt": "ab" * (limit // 2)})  # at the limit: tokenized
        assert r.status_code == 200, r.text


# -- sampling fields -------------------------------------------------------------------------------


@pytest.mark.parametrize("path, at_limit, over_limit, param, words", [
    ("/v1/completions", completion(n=MAX_N), completion(n=MAX_N + 1), "n", [str(MAX_N)]),
    ("/v1/chat/completions", chat(n=MAX_N), chat(n=MAX_N + 1), "n", [str(MAX_N)]),
    ("/v1/completions", completion(prompt=["Hi"] * (MAX_SEQUENCES_PER_REQUEST // MAX_N), n=MAX_N),
     completion(prompt=["Hi"] * (MAX_SEQUENCES_PER_REQUEST + 1)), "prompt", [str(MAX_SEQUENCES_PER_REQUEST)]),
    ("/v1/completions", completion(logprobs=MAX_LOGPROBS), completion(logprobs=MAX_LOGPROBS + 1), "logprobs",
     [str(MAX_LOGPROBS)]),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=MAX_LOGPROBS),
     chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), "top_logprobs", [str(MAX_LOGPROBS)]),
    ("/v1/completions", completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
     completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop", [str(MAX_STOP_STRINGS)]),
    ("/v1/chat/completions", chat(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
     chat(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop", [str(MAX_STOP_STRINGS)]),
    ("/v1/completions", completion(stop=["x" * MAX_STOP_STRING_LENGTH]),
     completion(stop=["x" * (MAX_STOP_STRING_LENGTH + 1)]), "stop", [str(MAX_STOP_STRING_LENGTH)]),
    ("/v1/chat/completions", chat(stop="x" * MAX_STOP_STRING_LENGTH), chat(stop="x" * (MAX_STOP_STRING_LENGTH + 1)),
     "stop", [str(MAX_STOP_STRING_LENGTH)]),
], ids=["n", "n-chat", "prompts-x-n", "logprobs", "top_logprobs", "stop-count", "stop-count-chat", "stop-length",
        "stop-length-chat"])
def test_request_field_limits(http, path, at_limit, over_limit, param, words):
    r = http.post(path, json=at_limit)
    assert r.status_code == 200, r.text[:500]
    assert_error(http.post(path, json=over_limit), 400, param, *words)
    assert_served(http)


# -- invalid Unicode -------------------------------------------------------------------------------

# JSON bodies whose bytes are not UTF-8: a stray byte, an overlong encoding, a truncated sequence
# at the end of a string; and a surrogate encoded as UTF-8 would encode it (CESU-8), which
# Python's JSON reader takes in as a lone surrogate, so it is the field's text that is refused.
BAD_BYTES = [b"\xff", b"\xc0\xaf", b"\xe2\x82"]
SURROGATE = b"\xed\xa0\x80"


@pytest.mark.parametrize("path, template, field", [
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "a%sb", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a%sb"}], "max_tokens": 1}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "stop": ["%s"], "max_tokens": 1}',
     "stop.0"),
    ("/tokenize", b'{"prompt": "%s"}', "prompt"),
    ("/detokenize", b'{"tokens": [1], "model": "%s"}', "model"),
], ids=["prompt", "content", "stop", "tokenize", "detokenize"])
def test_invalid_utf8_anywhere_is_a_400(http, path, template, field):
    for bad in BAD_BYTES:
        r = http.post(path, content=template % bad, headers={"content-type": "application/json"})
        assert_error(r, 400, None, "not valid UTF-8", f"{bad[0]:#04x}")
    r = http.post(path, content=template % SURROGATE, headers={"content-type": "application/json"})
    assert_error(r, 400, field, "invalid Unicode", "lone surrogate")
    assert_served(http)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(stop=["ok", "\udc80"]), "stop.1"),
    ("/v1/completions", completion(logit_bias={"\ud800": 1}), "logit_bias"),
    ("/v1/completions", completion(guided_json={"type": "string", "\ud83d": 1}), "guided_json"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "Hi", "name": "\ud800x"}]), "messages.0.name"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"\udbff": {"type": "string"}}}}}]), "tools.0.function.parameters.properties"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["\udc00"]}}}), "response_format.json_schema.schema.enum.0"),
    ("/detokenize", {"tokens": [1], "\ud800": 1}, None),  # a field name: pydantic refuses it first
])
def test_lone_surrogates_in_any_string_are_a_400(http, path, body, param):
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    error = assert_error(r, 400, param)
    assert "invalid unicode" in error["message"].lower() or "unicode string" in error["message"], error
    assert_served(http)
