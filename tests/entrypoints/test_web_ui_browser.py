"""The web page in a real browser: headless Chromium (the system's: Debian's `chromium`) driven
by Playwright against a real server. A chat streams its answer with TTFT and tokens/s under it
and survives a reload; an answer's Markdown is rendered (lists, code blocks, links) and markup in
it never becomes HTML; Stop aborts the request in the engine; the engine view follows a load
(its charts drawn); with `--api-key` the page asks for the key and both views work with it.
Skipped, naming what is missing, where Playwright or Chromium is not installed."""

from __future__ import annotations

import json
import re

import pytest

from tests.serving import scrape_metrics
from tests.web_page import VIEWPORT, Load, last_answer, launch, send_chat, why_no_browser

pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_no_browser() is not None,
                                                   reason=f"browser tests: {why_no_browser()}")]

TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, errors  # no uncaught error in the page's script


def open_page(page, url: str, view: str = "") -> None:
    page.goto(f"{url}/{view}")
    page.wait_for_selector("#server-status.ok")


def test_a_chat_streams_its_answer_with_timings_and_survives_a_reload(page, server):
    open_page(page, server.url)
    # Count the answer's text as it changes: a streamed answer grows in many steps.
    page.evaluate("""() => {
        window.textVersions = new Set();
        new MutationObserver(() => {
            const answer = [...document.querySelectorAll('.msg.assistant .text')].pop();
            if (answer) window.textVersions.add(answer.textContent);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    send_chat(page, "What is the capital of France?", temperature="0", max_tokens="16",
              system_prompt="You are a geography teacher.")
    meta = last_answer(page).locator(".meta")
    meta.wait_for(state="visible")
    text = last_answer(page).locator(".text").inner_text()
    assert text.strip()
    assert re.fullmatch(r"TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens · finish: (stop|length)", meta.inner_text()), \
        meta.inner_text()
    assert page.evaluate("window.textVersions.size") >= 3
    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.locator(".msg.user .text").inner_text() == "What is the capital of France?"
    assert last_answer(page).locator(".text").inner_text() == text
    assert page.input_value("#system-prompt") == "You are a geography teacher."
    assert page.input_value("#max-tokens") == "16"
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0


# An answer as a model might stream it: markup meant to run, a numbered list, a fenced code block
# holding markup, a link and a link that must not become one.
MARKDOWN_ANSWER = ('Here is <img src=x onerror="window.__xss=1"> as text.\n\n'
                   "Steps:\n1. Install it\n2. Run **it**\n3. Done\n\n"
                   "```python\nprint('<b>hi</b>')\n```\n"
                   "See [the docs](https://example.com/docs) or [this](javascript:window.__xss=2).")


def sse_answer(text: str, piece: int = 7) -> str:
    """A streamed chat completion of `text` in pieces of `piece` characters, as the server sends it."""
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": text[i:i + piece]}, "finish_reason": None}]}
               for i in range(0, len(text), piece)]
    events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45}}]
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"


def check_markdown_answer(page) -> None:
    answer = last_answer(page).locator(".text")
    assert "<img src=x onerror=" in answer.inner_text()  # shown as the characters it is
    assert page.locator(".msg img, .msg script, .msg [onerror]").count() == 0
    assert page.evaluate("window.__xss") is None
    assert answer.locator("ol > li").all_inner_texts() == ["Install it", "Run it", "Done"]
    assert answer.locator("ol > li strong").inner_text() == "it"
    code = answer.locator("pre > code")
    assert code.inner_text() == "print('<b>hi</b>')" and code.get_attribute("class") == "language-python"
    assert answer.locator("b").count() == 0
    (link,) = answer.locator("a").all()
    assert link.get_attribute("href") == "https://example.com/docs" and link.inner_text() == "the docs"
    assert "noopener" in link.get_attribute("rel").split()
    assert "[this](javascript:window.__xss=2)" in answer.inner_text()


def test_an_answer_is_rendered_as_markdown_and_never_as_html(page, server):
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=sse_answer(MARKDOWN_ANSWER)))
    open_page(page, server.url)
    page.click("#new-chat")
    send_chat(page, "Show me some Markdown.")
    last_answer(page).locator(".meta").wait_for(state="visible")
    check_markdown_answer(page)
    page.reload()  # restored from local storage, rendered again
    page.wait_for_selector(".msg.assistant pre")
    check_markdown_answer(page)
    # every prefix, as the answer is re-rendered while it streams: no element from its markup, no error
    made = page.evaluate("""(text) => {
        const made = [];
        for (let n = 0; n <= text.length; n++) {
            const div = document.createElement('div');
            div.append(renderMarkdown(text.slice(0, n)));
            if (div.querySelector('img, script, b, [onerror]')) made.push(n);
        }
        return made;
    }""", MARKDOWN_ANSWER)
    assert made == []
    assert page.evaluate("window.__xss") is None
    page.click("#new-chat")


def test_stop_aborts_the_request_in_the_engine(page, server):
    open_page(page, server.url)
    page.click("#new-chat")
    before = scrape_metrics(server.url)
    send_chat(page, "Count from 1 to 1000, one number per line.", temperature="0", max_tokens="2000")
    page.wait_for_function("document.querySelector('.msg.assistant .text').textContent.length > 5")
    page.click("#stop")
    meta = last_answer(page).locator(".meta")
    meta.wait_for(state="visible")
    assert meta.inner_text().startswith("stopped · TTFT"), meta.inner_text()
    assert page.is_visible("#send") and not page.is_visible("#stop")
    aborted = "tokenmill_request_success_total{finished_reason=abort}"
    for _ in range(100):  # the server sees the connection close, then the engine drops the request
        after = scrape_metrics(server.url)
        if after[aborted] > before[aborted] and after["tokenmill_num_requests_running"] == 0:
            break
        page.wait_for_timeout(100)
    assert after[aborted] == before[aborted] + 1
    assert after["tokenmill_num_requests_running"] == 0 and after["tokenmill_kv_cache_usage_perc"] == 0
    assert after["tokenmill_generation_tokens_total"] == before["tokenmill_generation_tokens_total"]  # none finished


def colored_pixels(page, canvas_id: str) -> int:
    """Pixels of the canvas that are drawn in the chart's blue (generated tokens, the line)."""
    return page.evaluate("""(id) => {
        const c = document.getElementById(id);
        const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4) if (data[i + 2] > 200 && data[i] < 80 && data[i + 3] > 200) n++;
        return n;
    }""", canvas_id)


def test_the_engine_view_follows_a_load(page, server):
    open_page(page, server.url, "#engine")
    page.wait_for_function("document.getElementById('stat-steps').textContent !== '–'")
    steps_before = int(page.inner_text("#stat-steps").replace(",", ""))
    with Load(server.url, concurrency=3, num_requests=3, max_tokens=24) as load:
        page.wait_for_function("Number(document.getElementById('stat-running').textContent) >= 2")
        page.wait_for_function("parseFloat(document.getElementById('stat-output-tps').textContent) > 0")
        page.wait_for_function("parseFloat(document.getElementById('stat-kv').textContent) > 0")
        while not load.done():
            page.wait_for_timeout(100)
    assert not load.errors, load.errors
    page.wait_for_function("document.getElementById('stat-running').textContent === '0'")
    steps_after = int(page.inner_text("#stat-steps").replace(",", ""))
    assert steps_after > steps_before
    assert int(page.inner_text("#ttft-count").replace(",", "")) >= 3
    assert page.inner_text("#itl-p50").endswith(" ms")
    assert page.inner_text("#steps-caption").startswith("Steps ")
    assert colored_pixels(page, "steps-chart") > 0 and colored_pixels(page, "tps-chart") > 0
    page.click("#tab-chat")  # leaving the view closes the stream
    assert page.locator("#view-engine").is_hidden()


def test_the_page_asks_for_the_api_key_and_sends_it(page, keyed_server):
    page.goto(keyed_server.url)
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "sekret")
    page.press("#key-input", "Enter")
    page.wait_for_selector("#server-status.ok")
    assert page.inner_text("#model-name") == "smollm2-135m"
    send_chat(page, "Say hello.", max_tokens="4")
    meta = last_answer(page).locator(".meta")
    meta.wait_for(state="visible")
    assert "TTFT" in meta.inner_text() and "error" not in meta.inner_text()
    page.click("#tab-engine")
    page.wait_for_function("document.getElementById('stat-steps').textContent !== '–'")
    assert page.inner_text("#server-status") == "live"
