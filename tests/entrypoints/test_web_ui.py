"""The web page's contract over HTTP, against real servers: the page and its assets at `/`
(offline: nothing from another host), the stats stream's events (every field the page reads,
every step of a load, counts equal to the engine's counters, the prefix cache's tiers), the
API key on the stream, `--no-web-ui`, and a stream that ends when the server drains. The latency
window's percentiles and the tiers' snapshot on plain numbers first. The page in a browser:
test_web_ui_browser.py."""

from __future__ import annotations

import json
import re
import signal
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.serving import BASE_FLAGS, MODEL, ServerProcess, scrape_metrics
from tests.web_page import Load
from tokenmill.engine.async_llm import EngineStats, StepRecord
from tokenmill.entrypoints.openai.metrics import RecentLatencies
from tokenmill.entrypoints.openai.stats_stream import TIERS, _tokens_in_window, tiers_snapshot

WEB_DIR = Path(__file__).resolve().parents[2] / "tokenmill" / "entrypoints" / "web"
# Every field of an event and its JSON type(s).
FIELDS = {
    "ready": bool, "model": str, "num_running": int, "num_waiting": int, "kv_cache_usage": (int, float),
    "num_blocks": int, "num_free_blocks": int, "num_host_blocks": int, "num_free_host_blocks": int,
    "num_steps": int, "num_preemptions": int, "num_swapped_out_blocks": int, "num_swapped_in_blocks": int,
    "prefix_cache_hits": int, "prefix_cache_queries": int, "prefix_cache_hit_rate": (float, type(None)),
    "output_tokens_per_s": (int, float), "prompt_tokens_per_s": (int, float), "ttft": (dict, type(None)),
    "itl": (dict, type(None)), "steps": list, "tiers": dict,
}
TIER_FIELDS = {"hits", "misses", "blocks", "bytes", "capacity_bytes"}


# -- the last minute's latencies, on plain numbers ------------------------------------------------


def test_recent_latencies_percentiles_are_the_buckets_of_the_nearest_ranks():
    window = RecentLatencies(window=60)
    assert window.percentiles((0.5,), now=0.0) == [None]
    for i in range(1, 101):  # 1 ms .. 100 ms, one a millisecond apart
        window.observe(i / 1000, now=10.0)
    p50, p90, p99, p100 = window.percentiles((0.5, 0.9, 0.99, 1.0), now=10.0)
    for got, exact in ((p50, 0.050), (p90, 0.090), (p99, 0.099), (p100, 0.100)):
        assert abs(got - exact) / exact < 2 ** (1 / 16) - 1, (got, exact)  # within its bucket
        assert RecentLatencies.bucket(got) == RecentLatencies.bucket(exact)
    assert window.count == 100


def test_recent_latencies_forget_what_left_the_window():
    window = RecentLatencies(window=60)
    window.observe(1.0, now=100.2)
    window.observe(0.010, now=130.9)
    assert window.percentiles((1.0,), now=159.9) == [pytest.approx(1.0, rel=0.03)]  # both still in
    assert window.percentiles((1.0,), now=160.0) == [pytest.approx(0.010, rel=0.03)]  # second 100 has left
    assert window.count == 1
    assert window.percentiles((0.5,), now=191.0) == [None] and window.count == 0
    window.observe(1e-9, now=200.0)  # below the first bucket, above the last: kept at the ends
    window.observe(1e9, now=200.0)
    assert window.percentiles((0.5, 1.0), now=200.0) == [RecentLatencies.bucket_middle(0),
                                                         RecentLatencies.bucket_middle(RecentLatencies.NUM_BUCKETS - 1)]


def test_token_rates_cover_the_window_or_the_whole_log_when_it_is_shorter():
    steps = [StepRecord(i, end_time=float(i), seconds=0.5, num_prefill_tokens=10, num_generated_tokens=4)
             for i in range(1, 11)]  # steps ending at 1 s .. 10 s
    assert _tokens_in_window(steps, now=10.0, window=5.0, maxlen=100) == (50, 20, 5.0)  # steps 6..10
    assert _tokens_in_window(steps, now=20.0, window=5.0, maxlen=100) == (0, 0, 5.0)
    # a full log younger than the window: its tokens over the time it spans (from step 1's start)
    assert _tokens_in_window(steps, now=10.0, window=60.0, maxlen=10) == (100, 40, 9.5)


# -- the page and the stream of a real server -----------------------------------------------------


def test_the_tiers_in_the_stream_are_the_engines_counters_in_blocks_bytes_and_mean_latencies():
    stats = EngineStats(bytes_per_block=1000, tier_hits=(7, 3, 2), tier_misses=(5, 2, 1), tier_blocks=(10, 4, 9),
                        tier_capacity_blocks=(12, 6, 100), num_promoted_blocks=3, num_demoted_blocks=8,
                        num_disk_written_blocks=4, num_disk_read_blocks=0, num_disk_corrupt_blocks=1,
                        disk_write_seconds=0.5)
    tiers = tiers_snapshot(stats)
    assert tiers["host"] == {"hits": 3, "misses": 2, "blocks": 4, "bytes": 4000, "capacity_bytes": 6000}
    assert tiers["disk"]["capacity_bytes"] == 100_000 and tiers["device"]["hits"] == 7
    assert (tiers["promoted_blocks"], tiers["demoted_blocks"], tiers["disk_corrupt_blocks"]) == (3, 8, 1)
    assert tiers["disk_write_ms"] == 125.0 and tiers["disk_read_ms"] is None  # no read yet
    assert json.loads(json.dumps(tiers)) == tiers


def test_the_page_reads_only_tier_fields_the_stream_sends():
    script = (WEB_DIR / "app.js").read_text()
    body = script[script.index("function showTiers(t)"):]
    body = body[: body.index("\n}\n")]
    tiers = tiers_snapshot(EngineStats())
    read = set(re.findall(r"\bt\.([a-z_]+)", body))
    assert read and read <= set(tiers), read - set(tiers)
    per_tier = set(re.findall(r"\btier\.([a-z_]+)", body))
    assert per_tier and per_tier <= TIER_FIELDS, per_tier - TIER_FIELDS
    html = (WEB_DIR / "index.html").read_text()
    for name in TIERS:  # every cell the script fills is on the page
        for cell in ("hits", "misses", "rate", "blocks", "bytes", "capacity"):
            assert f'id="tier-{name}-{cell}"' in html


@contextmanager
def stats_events(url: str, interval: float = 0.1, **headers: str):
    """The stats stream's events, parsed, as they arrive."""
    with httpx.stream("GET", f"{url}/stats/stream", params={"interval": interval}, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        yield (json.loads(line.removeprefix("data:")) for line in r.iter_lines() if line.startswith("data:"))


def check_event(event: dict) -> None:
    assert set(event) == set(FIELDS), set(event) ^ set(FIELDS)
    for name, kind in FIELDS.items():
        assert isinstance(event[name], kind), (name, event[name])
    assert 0 <= event["kv_cache_usage"] <= 1 and 0 <= event["num_free_blocks"] <= event["num_blocks"]
    for name in ("ttft", "itl"):
        if event[name] is not None:
            summary = event[name]
            assert set(summary) == {"count", "p50_ms", "p90_ms", "p99_ms"} and summary["count"] > 0
            assert 0 < summary["p50_ms"] <= summary["p90_ms"] <= summary["p99_ms"]
    tiers = event["tiers"]
    for name in TIERS:
        assert set(tiers[name]) == TIER_FIELDS and all(isinstance(v, int) and v >= 0 for v in tiers[name].values())
        assert tiers[name]["bytes"] <= tiers[name]["capacity_bytes"]
    assert tiers["device"]["capacity_bytes"] > 0 and tiers["device"]["blocks"] <= event["num_blocks"]
    for step in event["steps"]:
        assert len(step) == 4 and step[1] >= 0 and step[2] >= 0 and step[3] > 0, step


@pytest.mark.slow
def test_the_page_and_its_assets_are_served_and_load_nothing_from_another_host(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert sorted(re.findall(r'(?:src|href)="([^"]*)"', page.text)) == ["data:,", "web/app.js", "web/style.css"]
    texts = [page.text]
    for name, media_type in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{server.url}/web/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media_type)
        assert r.text == (WEB_DIR / name).read_text()
        texts.append(r.text)
    for text in texts:  # no URL of another host, no stylesheet import, no font or image from elsewhere
        assert not re.search(r"https?:|wss?:|//[\w-]+\.[\w.-]+/|@import|url\(", text, re.I)
    for path in ("/web/__init__.py", "/web/index.html.bak", "/web/"):
        assert httpx.get(f"{server.url}{path}").status_code == 404, path
    # the API is unchanged beside it, and the page is not part of its schema
    for path in ("/health", "/metrics", "/v1/models", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "/" not in paths and "/stats/stream" not in paths and "/v1/chat/completions" in paths


def test_the_page_script_never_parses_text_as_html():
    """Answers are Markdown built from text nodes (app.js: renderMarkdown): no API that parses a
    string as HTML appears in the script, so nothing a model writes can become markup."""
    script = (WEB_DIR / "app.js").read_text()
    assert "function renderMarkdown(" in script and "textContent" in script
    for api in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser",
                "createContextualFragment", "srcdoc", "eval(", "new Function"):
        assert api not in script, api


@pytest.mark.slow
def test_the_stats_stream_carries_every_step_of_a_load(server):
    before = scrape_metrics(server.url)
    with stats_events(server.url) as events:
        first = next(events)
        check_event(first)
        assert first["ready"] and first["model"] == MODEL
        assert first["num_steps"] == before["tokenmill_engine_steps_total"]
        seen = []
        with Load(server.url, concurrency=3, num_requests=3, max_tokens=12) as load:
            while not load.done():
                seen.append(next(events))
        assert not load.errors, load.errors
        after = scrape_metrics(server.url)
        while seen[-1]["num_steps"] < after["tokenmill_engine_steps_total"]:
            seen.append(next(events))
    for event in seen:
        check_event(event)
    steps = [step for event in seen for step in event["steps"]]
    # every step once, in order, and its tokens are the engine's counters' growth
    assert [s[0] for s in steps] == list(range(first["num_steps"] + 1, seen[-1]["num_steps"] + 1))
    grew = lambda name: after[name] - before[name]  # noqa: E731
    assert sum(s[2] for s in steps) == grew("tokenmill_engine_generated_tokens_total") == 3 * 12
    assert sum(s[1] for s in steps) == grew("tokenmill_prefill_tokens_total") > 0
    assert max(e["num_running"] for e in seen) >= 1 and max(e["output_tokens_per_s"] for e in seen) > 0
    last = seen[-1]
    assert last["ttft"]["count"] >= 3 and last["itl"]["count"] >= 3 * 11
    assert last["num_running"] == 0 and last["prefix_cache_queries"] >= 3


@pytest.mark.slow
def test_the_page_reads_only_fields_the_stream_sends(server):
    with stats_events(server.url) as events:
        event = next(events)
    script = (WEB_DIR / "app.js").read_text()
    read = set(re.findall(r"\bs\.([a-z_]+)", script))  # showEngine(s) reads the event as `s`
    assert read and read <= set(event), read - set(event)
    # the latency summaries: check_event holds their keys to count, p50_ms, p90_ms, p99_ms
    assert '["p50", "p90", "p99"]' in script and "`${p}_ms`" in script and "summary.count" in script


@pytest.mark.slow
def test_the_api_key_guards_the_stream_but_not_the_page(keyed_server):
    url = keyed_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{url}/stats/stream", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with stats_events(url, Authorization="Bearer sekret") as events:
        check_event(next(events))
    for path in ("/", "/web/app.js", "/web/style.css"):
        assert httpx.get(f"{url}{path}").status_code == 200, path


@pytest.mark.slow
def test_a_bad_interval_is_a_400_naming_it(server):
    for interval in ("0.01", "11", "fast"):
        r = httpx.get(f"{server.url}/stats/stream", params={"interval": interval}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "interval", (interval, r.text)


@pytest.fixture(scope="module")
def no_web_ui(default_model_path, tmp_path_factory):
    proc = ServerProcess(MODEL, *BASE_FLAGS, "--no-web-ui", "--shutdown-timeout", "30",
                         log_path=tmp_path_factory.mktemp("no_web_ui") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.mark.slow
def test_no_web_ui_serves_no_page_and_keeps_the_api_and_the_stream(no_web_ui):
    for path in ("/", "/web/app.js", "/web/style.css"):
        assert httpx.get(f"{no_web_ui.url}{path}").status_code == 404, path
    assert httpx.get(f"{no_web_ui.url}/v1/models").status_code == 200
    with stats_events(no_web_ui.url) as events:
        check_event(next(events))


@pytest.mark.slow
def test_sigterm_ends_an_open_stats_stream_and_the_server_exits_0(no_web_ui):
    """(Last: it stops the module's server.) Without its end the stream would hold the exit
    until uvicorn's grace period cut the connection, mid-chunk."""
    received = 0
    with stats_events(no_web_ui.url) as events:
        next(events)
        no_web_ui.proc.send_signal(signal.SIGTERM)
        for _ in events:  # ends cleanly: a connection cut mid-stream raises here
            received += 1
            assert received < 100, "the stream went on after SIGTERM"
    assert no_web_ui.proc.wait(timeout=30) == 0
