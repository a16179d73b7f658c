"""The web page of `tokenmill serve`, as a person uses it: headless Chromium (the system's, e.g.
Debian's `chromium`) driven by Playwright, plus a load of requests to watch. Shared by the
browser tests (tests/entrypoints/test_web_ui_browser.py) and scripts/web_screenshots.py."""

from __future__ import annotations

import shutil
import threading

import httpx

from tests.serving import MODEL

CHROMIUM_NAMES = ("chromium", "chromium-browser")
VIEWPORT = {"width": 1280, "height": 800}


def chromium_path() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def why_no_browser() -> str | None:
    """Why the browser cannot run here (what to install), or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright; it is in tokenmill's [test] extra)"
    if chromium_path() is None:
        return f"no Chromium on PATH (none of {', '.join(CHROMIUM_NAMES)}): apt-get install chromium"
    return None


def launch(playwright):
    """Headless Chromium from the system (Playwright's own browser download is not needed)."""
    # Chromium's sandbox refuses to start as root, as in CI containers, whose /dev/shm may be small.
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                      args=["--no-sandbox", "--disable-dev-shm-usage"])


def send_chat(page, text: str, **settings: str) -> None:
    """Set the sampling controls given (element ids: temperature, top-p, max-tokens, seed,
    system-prompt) and send `text` with the Enter key."""
    for element_id, value in settings.items():
        page.fill(f"#{element_id.replace('_', '-')}", value)
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page):
    return page.locator(".msg.assistant").last


class Load:
    """`concurrency` threads sending completions of `max_tokens` (EOS ignored) to a server until
    `num_requests` are done or `stop()`."""

    def __init__(self, url: str, concurrency: int = 4, num_requests: int = 8, max_tokens: int = 32,
                 headers: dict[str, str] | None = None):
        self.url, self.max_tokens, self.headers = url, max_tokens, headers or {}
        self.remaining = num_requests
        self.lock = threading.Lock()
        self.stopped = False
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopped = True
        for thread in self.threads:
            thread.join(120)

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self.threads)

    def _run(self) -> None:
        while not self.stopped:
            with self.lock:
                if self.remaining == 0:
                    return
                self.remaining -= 1
                n = self.remaining
            prompt = f"Request {n}: " + "Write a long story about the sea. " * (1 + n % 8)  # prompts of 10-60 tokens
            body = {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True}
            r = httpx.post(f"{self.url}/v1/completions", json=body, headers=self.headers, timeout=120)
            if r.status_code != 200:
                self.errors.append(f"{r.status_code} {r.text[:200]}")
