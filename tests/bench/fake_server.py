"""A tiny OpenAI-shaped streaming server for `bench` tests that need no model.

What it does with a request is chosen by the first word of its prompt (or last message):
- `ok`: waits `header_delay` s, then streams 4 tokens `token_gap` s apart (the third one as an
  event without text, like a token whose text the server holds back), usage, `[DONE]`.
- `multi`: like ok, but the last event carries two tokens (usage says 4 over 3 events).
- `nousage`: like ok, without the usage event.
- `fail500`: answers 500 with an OpenAI error body ("boom") at once.
- `drop`: streams one token, then closes the connection without `[DONE]`.
- `errorevent`: streams one token, then an error event ("engine died") and `[DONE]`.
- `hang`: sends nothing for `hang_s` seconds (past the client's timeout).
It records the `time.perf_counter()` at which each request arrived (same clock as the client's,
since it runs in a thread of the test process).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
    def __init__(self, header_delay: float = 0.2, token_gap: float = 0.05, hang_s: float = 3.0):
        self.header_delay = header_delay
        self.token_gap = token_gap
        self.hang_s = hang_s
        self.received: list[tuple[float, str]] = []  # (arrival time, behaviour)
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Server(ThreadingHTTPServer):
    # the default listen backlog (5) drops connections of a burst, which the client retries 1 s later
    request_queue_size = 128


def _handler(fake: FakeOpenAIServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_error(404)

        def do_POST(self) -> None:
            arrived = time.perf_counter()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = "messages" in body
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            behaviour = prompt.split()[0]
            with fake._lock:
                fake.received.append((arrived, behaviour))
            if behaviour == "fail500":
                payload = json.dumps({"error": {"message": "boom", "type": "server_error", "code": 500}}).encode()
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            time.sleep(fake.hang_s if behaviour == "hang" else fake.header_delay)
            if behaviour == "hang":
                return
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self._stream(behaviour, chat)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _send(self, payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def _event(self, chat: bool, text: str | None, finish: str | None = None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return {"id": "x", "object": "chat.completion.chunk", "choices": [choice]}
            return {"id": "x", "object": "text_completion",
                    "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}

        def _stream(self, behaviour: str, chat: bool) -> None:
            if chat:
                self._send({"id": "x", "object": "chat.completion.chunk",
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            self._send(self._event(chat, " one"))
            if behaviour == "drop":
                return
            if behaviour == "errorevent":
                self._send({"error": {"message": "engine died", "type": "server_error", "code": 503}})
                self._send("[DONE]")
                return
            time.sleep(fake.token_gap)
            self._send(self._event(chat, " two"))
            time.sleep(fake.token_gap)
            if behaviour == "multi":
                self._send(self._event(chat, " three four", "length"))
            else:
                self._send(self._event(chat, None))  # a token with no text yet
                time.sleep(fake.token_gap)
                self._send(self._event(chat, " three four", "length"))
            if behaviour != "nousage":
                self._send({"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4,
                                                                "total_tokens": 11}})
            self._send("[DONE]")

    return Handler
