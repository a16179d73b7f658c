"""One streamed request to an OpenAI-compatible endpoint and the timings a client sees.

Every time is taken on this client with `time.perf_counter()`, starting at the moment the request
is handed to the HTTP library (the *send time*: after any wait for a concurrency slot, before
connecting), and each stream line is stamped when it is read.

How token timings are derived from the stream (servers send text, not tokens):
- An *output event* is an SSE event whose first choice carries output. It carries one token when
  it has text (`delta.content` / `delta.reasoning_content` for chat, `text` for completions), and
  also when it has neither text nor a role nor a finish reason (a token whose text the server holds
  back, e.g. half of a UTF-8 character: tokenmill sends `"delta": {}` then). The opening
  `{"role": "assistant"}` event and a text-less closing event with only `finish_reason` carry none.
- `usage.completion_tokens` (the stream's last event, asked for with `stream_options.include_usage`)
  is the output token count. Tokens it has beyond those counted on the events (an event that
  carried several tokens: an EOS or a stop string closing the stream, text flushed at the end, or a
  server that sends one event per engine iteration with several tokens per iteration, as with
  speculative decoding) are credited to the last output event.
- TTFT = first output event - send time. E2E = end of stream (`[DONE]`) - send time.
- ITL: one sample per output token after the first. An event carrying k tokens that arrived g
  seconds after the previous output event gives k samples of g / k (its delay spread over the
  tokens it delivered); the first event's extra k - 1 tokens arrived with the first token and give
  gaps of 0. So a successful request has exactly `output_tokens - 1` ITL samples, and they add up
  to the time from the first to the last output event.
- TPOT = (E2E - TTFT) / (output_tokens - 1), for requests with at least 2 output tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from tokenmill.bench.datasets import BenchRequest

API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(slots=True)
class RequestResult:
    """One request's outcome. Times are seconds; `scheduled_time` and `start_time` are relative to
    the start of the benchmark, every other time is relative to this request's `start_time`."""

    index: int
    success: bool = False
    error: str | None = None
    http_status: int | None = None
    scheduled_time: float = 0.0  # when the arrival process released the request
    start_time: float = 0.0  # when it was sent (after any wait for a concurrency slot)
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    max_tokens: int | None = None  # what was asked for
    prompt_tokens: int | None = None
    output_tokens: int = 0
    num_output_events: int = 0
    finish_reason: str | None = None
    usage_reported: bool = False  # False: output_tokens counted from events, prompt_tokens unknown
    # Speculative decoding, when the server reports it: tokenmill's usage.speculative_decoding
    # (draft_tokens, accepted_tokens, verifications), llama-server's timings (draft_n,
    # draft_n_accepted; no verification count)
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    verifications: int | None = None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return {
            "index": self.index, "success": self.success, "error": self.error, "http_status": self.http_status,
            "scheduled_time_s": self.scheduled_time, "start_time_s": self.start_time, "ttft_s": self.ttft,
            "tpot_s": self.tpot, "e2e_s": self.e2e, "itl_s": self.itl, "max_tokens": self.max_tokens, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "num_output_events": self.num_output_events,
            "finish_reason": self.finish_reason, "usage_reported": self.usage_reported,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "verifications": self.verifications,
        }


class TokenEvents:
    """Output events of one stream as (receive time, tokens carried); turns them into TTFT and ITL."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def add(self, t: float, num_tokens: int) -> None:
        self.times.append(t)
        self.tokens.append(num_tokens)

    def finalize(self, num_output_tokens: int | None) -> tuple[float | None, list[float], int]:
        """(time of the first token, ITL samples, output token count). `num_output_tokens` is
        the usage count, or None to trust the events' own count."""
        counted = sum(self.tokens)
        total = counted if num_output_tokens is None else num_output_tokens
        tokens = self.tokens
        if total > counted and tokens:
            tokens[-1] += total - counted  # see the module docstring
        first_token_time = None
        itl: list[float] = []
        previous = None
        for t, k in zip(self.times, tokens):
            if k == 0:
                continue
            if previous is None:
                first_token_time = t
                itl.extend([0.0] * (k - 1))
            else:
                itl.extend([(t - previous) / k] * k)
            previous = t
        return first_token_time, itl, total


def event_tokens(event: dict, chat: bool) -> tuple[int, str | None] | None:
    """(tokens carried, finish reason) of one SSE event's first choice; None when it has no choice
    (the closing usage event)."""
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = min(choices, key=lambda c: c.get("index", 0))
    finish = choice.get("finish_reason")
    if chat:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            return 1, finish
        return (0 if "role" in delta or finish else 1), finish
    if choice.get("text"):
        return 1, finish
    return (0 if finish else 1), finish


def build_body(request: BenchRequest, api: str, model: str, temperature: float, extra_body: dict) -> dict:
    body: dict = {"model": model, "max_tokens": request.max_tokens, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = request.as_messages()
    else:
        body["prompt"] = request.as_prompt()
    if request.ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body)
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict, chat: bool, result: RequestResult,
                       timeout: float, clock_origin: float) -> RequestResult:
    """Send one streaming request and fill `result`. Never raises for what the server or the
    network does: errors (HTTP status, an error event, a broken or unfinished stream, a timeout)
    are recorded in `result.error`."""
    t_send = time.perf_counter()
    result.start_time = t_send - clock_origin
    events = TokenEvents()
    usage = None
    done = False
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as response:
                result.http_status = response.status_code
                if response.status_code != 200:
                    raw = await response.aread()
                    result.error = f"HTTP {response.status_code}: {_error_message(raw)}"
                    return result
                async for line in response.aiter_lines():
                    t = time.perf_counter()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"error event: {_error_message(json.dumps(event))}"
                        return result
                    if event.get("usage"):
                        usage = event["usage"]
                    if event.get("timings"):
                        _llama_drafts(event["timings"], result)
                    carried = event_tokens(event, chat)
                    if carried is None:
                        continue
                    num_tokens, finish = carried
                    events.add(t - t_send, num_tokens)
                    result.finish_reason = finish or result.finish_reason
                t_end = time.perf_counter()  # [DONE] or the end of the body, before the connection is released
    except TimeoutError:
        result.error = f"timed out after {timeout:g} s"
        return result
    except Exception as e:  # noqa: BLE001  # a broken stream or body is this request's error, not the run's
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return result
    if not done and result.finish_reason is None:
        result.error = "stream ended without [DONE] or a finish_reason"
        return result
    completion_tokens = usage.get("completion_tokens") if usage else None
    result.usage_reported = completion_tokens is not None
    spec = (usage or {}).get("speculative_decoding")
    if spec:
        result.draft_tokens, result.accepted_tokens = spec.get("draft_tokens"), spec.get("accepted_tokens")
        result.verifications = spec.get("verifications")
    result.prompt_tokens = usage.get("prompt_tokens") if usage else None
    first, itl, total = events.finalize(completion_tokens)
    result.num_output_events = sum(1 for k in events.tokens if k)
    result.output_tokens = total
    if first is None or total < 1:
        result.error = "no output tokens"
        return result
    result.ttft = first
    result.e2e = t_end - t_send
    result.itl = itl
    result.success = True
    return result


def _error_message(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str) and message:
            return message[:500]
        if isinstance(error, str):
            return error[:500]
    except (json.JSONDecodeError, AttributeError):
        pass
    return text.strip()[:500] or "(empty body)"


def _llama_drafts(timings: dict, result: RequestResult) -> None:
    """llama-server's per-response draft counts (its `timings`), when it speculated."""
    if "draft_n" in timings:
        result.draft_tokens = timings["draft_n"]
        result.accepted_tokens = timings.get("draft_n_accepted")
