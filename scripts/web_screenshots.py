"""docs/images/web-chat.png and web-engine.png: the web page of `tokenmill serve`, in headless
Chromium (Debian's `chromium`, driven by Playwright), against a real server on the default model.

The chat view after one streamed answer; the engine view during a load of 16 concurrent
requests, once its charts have filled.

    python scripts/web_screenshots.py                 # the default model as `tokenmill serve` runs it
    python scripts/web_screenshots.py --server-args="--dtype float32"
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.serving import MODEL, ServerProcess  # noqa: E402
from tests.web_page import VIEWPORT, Load, last_answer, launch, send_chat, why_no_browser  # noqa: E402

IMAGES = REPO / "docs" / "images"
SYSTEM_PROMPT = "You are a concise assistant. Answer in two or three sentences."
QUESTION = "Give me three tips for writing clear technical documentation."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-args", default="", help="more flags for `tokenmill serve`")
    parser.add_argument("--output-dir", type=Path, default=IMAGES)
    args = parser.parse_args()
    if (reason := why_no_browser()) is not None:
        raise SystemExit(f"cannot take screenshots: {reason}")
    from playwright.sync_api import sync_playwright

    args.output_dir.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = ServerProcess(MODEL, "--log-stats-interval", "0", *shlex.split(args.server_args), log_path=log)
    try:
        server.wait_ready()
        with sync_playwright() as playwright:
            browser = launch(playwright)
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(120_000)
            page.goto(server.url)
            page.wait_for_selector("#server-status.ok")
            send_chat(page, QUESTION, temperature="0.7", top_p="0.95", max_tokens="160", seed="7",
                      system_prompt=SYSTEM_PROMPT)
            last_answer(page).locator(".meta").wait_for(state="visible")
            page.screenshot(path=str(args.output_dir / "web-chat.png"))

            page.click("#tab-engine")
            with Load(server.url, concurrency=16, num_requests=10_000, max_tokens=96):  # stopped on leaving
                page.wait_for_function("Number(document.getElementById('stat-running').textContent) >= 8")
                page.wait_for_timeout(8000)  # the step chart and the tok/s line fill in
                page.screenshot(path=str(args.output_dir / "web-engine.png"))
            browser.close()
    finally:
        server.stop()
    print(f"wrote {args.output_dir / 'web-chat.png'} and {args.output_dir / 'web-engine.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
