"""schemathesis hooks for scripts/fuzz_api.py (loaded by `st run` through SCHEMATHESIS_HOOKS).

Two jobs, in every phase (examples, coverage, fuzzing) and in both modes:
- keep each call short: a generated body's `max_tokens` / `max_completion_tokens` is clipped to
  MAX_TOKENS (set when absent), `n` to MAX_N, a batch of prompts to MAX_PROMPTS, `min_tokens` to
  the clipped `max_tokens`, so a request costs a few decode steps whatever the generator drew. Values of the wrong type or out
  of range (a negative `n`) are left as drawn: they are what negative mode is for.
- record every exchange as one JSON line in $TOKENMILL_FUZZ_LOG: operation, phase, mode, status,
  time, and the whole request for any 5xx, any server error inside an event stream, any answer
  slower than SLOW_S and any request that got no answer (a timeout or a dropped connection).
"""

from __future__ import annotations

import json
import os
import time

import schemathesis

MAX_TOKENS = 4
MAX_N = 2
MAX_PROMPTS = 4  # of a batch of prompts
SLOW_S = 2.0  # a response slower than this is recorded with its request
_LOG = os.environ.get("TOKENMILL_FUZZ_LOG")
_SENT_AT: dict[int, float] = {}  # id(case) -> when its request went out


def _clip(body: dict) -> None:
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if type(value) is int and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # chat's default (null is not sent) is the whole context
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > MAX_PROMPTS:
        body["prompt"] = prompt[:MAX_PROMPTS]
    n = body.get("n")
    if type(n) is int and n > MAX_N:
        body["n"] = MAX_N
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if type(body.get(k)) is int), MAX_TOKENS)
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens > max(limit, 0):
        body["min_tokens"] = max(limit, 0)


def _is_generating(case) -> bool:
    return case.method.upper() == "POST" and case.path in ("/v1/completions", "/v1/chat/completions")


@schemathesis.hook
def before_call(context, case, kwargs):
    if _is_generating(case) and isinstance(case.body, dict):
        _clip(case.body)
    kwargs.setdefault("timeout", float(os.environ.get("TOKENMILL_FUZZ_TIMEOUT", "60")))
    _SENT_AT[id(case)] = time.monotonic()


def _request_record(case, request=None) -> dict:
    body = request.body if request is not None else None
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="backslashreplace")
    return {
        "method": case.method.upper(),
        "path": case.formatted_path,
        "query": case.query or None,
        "headers": dict(request.headers) if request is not None else (case.headers or None),
        "body": body,
    }


def _meta(case) -> dict:
    meta = case.meta
    return {
        "operation": f"{case.method.upper()} {case.path}",
        "phase": str(meta.phase.name.value) if meta is not None else None,
        "mode": str(meta.generation.mode.value) if meta is not None else None,
    }


def _write(record: dict) -> None:
    if _LOG:
        with open(_LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=True) + "\n")


def _stream_error(response) -> str | None:
    """The first server-side error event of an SSE body, if any (a failure the status hides)."""
    if "text/event-stream" not in ";".join(response.headers.get("content-type", [])):
        return None
    for line in response.content.decode("utf-8", errors="replace").splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                error = json.loads(line[len("data: "):]).get("error")
            except ValueError:
                continue
            if isinstance(error, dict) and (error.get("type") == "server_error" or int(error.get("code") or 0) >= 500):
                return line
    return None


def _error_of(response) -> tuple[str | None, str | None]:
    try:
        error = json.loads(response.content)["error"]
        return error.get("param"), str(error.get("message"))[:200]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None


@schemathesis.hook
def after_call(context, case, response):
    _SENT_AT.pop(id(case), None)
    record = {**_meta(case), "status": response.status_code, "elapsed": round(response.elapsed, 4)}
    if 400 <= response.status_code < 500:
        record["param"], record["message"] = _error_of(response)
    stream_error = _stream_error(response)
    if response.status_code >= 500 or stream_error is not None or response.elapsed > SLOW_S:
        record["request"] = _request_record(case, response.request)
        record["response"] = response.content[:2000].decode("utf-8", errors="replace")
        if stream_error is not None:
            record["stream_error"] = stream_error
    _write(record)


@schemathesis.hook
def after_network_error(context, case, request):
    sent_at = _SENT_AT.pop(id(case), None)
    _write({**_meta(case), "status": None, "no_answer": True,
            "elapsed": round(time.monotonic() - sent_at, 4) if sent_at is not None else None,
            "request": _request_record(case, request)})
