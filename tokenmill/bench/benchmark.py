"""One `tokenmill bench serve` run: build the workload, drive it at the load pattern, summarize.

`BenchConfig` holds every knob (the CLI flags map 1:1 onto its fields); `run_benchmark` returns the
result as a JSON-ready dict: the config, the server and client it ran between, the summary, and
every request's samples.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from tokenmill.bench.client import API_PATHS, RequestResult, build_body, send_request
from tokenmill.bench.datasets import BenchRequest, DatasetConfig, build_requests
from tokenmill.bench.load import LoadPattern, run_load
from tokenmill.bench.metrics import parse_percentiles, parse_slos, summarize

APIS = ("auto", "chat", "completions")
# The "kind" field of a result file. Both kinds are defined here, which sweep and plot import,
# so that plot (reading either kind) does not import sweep, which draws with plot.
RESULT_KIND = "tokenmill-bench-serve"
SWEEP_KIND = "tokenmill-bench-sweep"


class BenchError(ValueError):
    """A bad flag or an unusable server; the message says which."""


@dataclass
class BenchConfig:
    # the server
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists at /v1/models
    api: str = "auto"  # auto: chat for datasets of messages, completions for raw prompts
    api_key: str | None = None
    label: str | None = None  # the series name in tables and plots; None: "MODEL @ host:port"
    # the workload (see datasets.py)
    dataset: str = "random"
    dataset_path: str | None = None
    num_requests: int = 100
    input_len: str = "256"
    output_len: str = "128"
    num_groups: int = 4
    system_prompt_len: int = 512
    question_len: str = "32"
    num_users: int = 32
    num_rounds: int = 6
    history_len: int = 300
    first_round: int = 1
    ignore_eos: bool | None = None
    tokenizer: str | None = None  # None: the server's /tokenize and /detokenize
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    seed: int = 0
    # the load (see load.py)
    concurrency: int | None = None
    request_rate: float = math.inf
    duration: float | None = None
    num_warmups: int = 0
    request_timeout: float = 600.0
    # the report (see metrics.py)
    percentiles: str = "50,90,99"
    slo: str | None = None
    cost_per_hour: float | None = None
    output: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise BenchError(f"api: must be one of {APIS}, got {self.api!r}")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise BenchError(f"base_url: expected http://HOST:PORT, got {self.base_url!r}")
        if self.num_warmups < 0:
            raise BenchError(f"num_warmups: must be >= 0, got {self.num_warmups}")
        if not self.request_timeout > 0:
            raise BenchError(f"request_timeout: must be > 0 seconds, got {self.request_timeout}")
        if self.cost_per_hour is not None and self.cost_per_hour < 0:
            raise BenchError(f"cost_per_hour: must be >= 0, got {self.cost_per_hour}")
        if not isinstance(self.extra_body, dict):
            raise BenchError(f"extra_body: must be a JSON object, got {self.extra_body!r}")
        # the derived objects validate their own fields: build them now so a bad flag fails before any request
        _ = self.dataset_config, self.load_pattern
        parse_percentiles(self.percentiles)
        parse_slos(self.slo)

    @classmethod
    def from_args(cls, args) -> BenchConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @property
    def root_url(self) -> str:
        """The server's root: `--base-url` with or without a trailing /v1."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def dataset_config(self) -> DatasetConfig:
        return DatasetConfig(name=self.dataset, num_requests=self.num_requests, path=self.dataset_path,
                             input_len=self.input_len, output_len=self.output_len, num_groups=self.num_groups,
                             system_prompt_len=self.system_prompt_len, question_len=self.question_len,
                             num_users=self.num_users, num_rounds=self.num_rounds, history_len=self.history_len,
                             first_round=self.first_round,
                             ignore_eos=self.ignore_eos, seed=self.seed)

    @property
    def load_pattern(self) -> LoadPattern:
        return LoadPattern(request_rate=self.request_rate, max_concurrency=self.concurrency, duration=self.duration)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["api_key"] = "<set>" if self.api_key else None  # never write the key into a result file
        d["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return d


def load_tokenizer(config: BenchConfig):
    from tokenmill.bench.tokenizer import HFTokenizer, ServerTokenizer

    if config.tokenizer:
        return HFTokenizer(config.tokenizer)
    return ServerTokenizer(config.root_url, config.headers)


def prepare_requests(config: BenchConfig) -> list[BenchRequest]:
    dataset = config.dataset_config
    tokenizer = load_tokenizer(config) if dataset.needs_tokenizer else None
    try:
        return build_requests(dataset, tokenizer)
    finally:
        if tokenizer is not None:
            tokenizer.close()


def discover_server(config: BenchConfig) -> dict:
    """What the server says about itself: its models (/v1/models) and version (/version, tokenmill)."""
    info: dict = {"root_url": config.root_url, "models": None, "version": None}
    try:
        r = httpx.get(f"{config.root_url}/v1/models", headers=config.headers, timeout=30)
        if r.status_code == 200:
            info["models"] = [m.get("id") for m in r.json().get("data", [])]
        r = httpx.get(f"{config.root_url}/version", headers=config.headers, timeout=30)
        if r.status_code == 200:
            info["version"] = r.json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return info


def run_benchmark(config: BenchConfig, requests: list[BenchRequest] | None = None, server: dict | None = None,
                  load_kind: str | None = None) -> dict:
    """One run. `requests` and `server` may be passed in (a sweep builds them once for every load)."""
    server = server if server is not None else discover_server(config)
    model = config.model or (server["models"] or [None])[0]
    if model is None:
        raise BenchError(f"cannot list the models at {config.root_url}/v1/models: pass --model")
    requests = requests if requests is not None else prepare_requests(config)
    api = config.api if config.api != "auto" else ("chat" if requests[0].messages is not None else "completions")
    pattern = config.load_pattern
    load_avg_start = _load_average()
    results, duration = asyncio.run(_drive(config, requests, api, model, pattern))
    summary = summarize(results, duration, parse_percentiles(config.percentiles), parse_slos(config.slo),
                        config.cost_per_hour)
    load_kind = load_kind or pattern.kind
    load_value = {"concurrency": config.concurrency, "poisson": config.request_rate,
                  "request_rate": config.request_rate}.get(load_kind)
    return {
        "kind": RESULT_KIND,
        "format_version": 1,
        "label": config.label or f"{model} @ {urlsplit(config.root_url).netloc}",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": pattern.describe(),
        "load_kind": load_kind,
        "load_value": load_value,
        "config": {**config.to_json(), "model": model, "api": api},
        "server": server,
        "client": {"platform": platform.platform(), "python": platform.python_version(), "num_cpus": os.cpu_count(),
                   "load_avg_start": load_avg_start, "load_avg_end": _load_average()},
        "summary": summary,
        "requests": [r.to_dict() for r in results],
    }


async def _drive(config: BenchConfig, requests: list[BenchRequest], api: str, model: str,
                 pattern: LoadPattern) -> tuple[list[RequestResult], float]:
    url = config.root_url + API_PATHS[api]
    bodies = [build_body(r, api, model, config.temperature, config.extra_body) for r in requests]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # never queue inside httpx
    # no httpx timeout: asyncio.timeout in send_request bounds each request as a whole
    async with httpx.AsyncClient(headers=config.headers, limits=limits, timeout=httpx.Timeout(None)) as client:

        async def send(index: int, scheduled: float, origin: float) -> RequestResult:
            result = RequestResult(index=index, scheduled_time=scheduled, max_tokens=requests[index].max_tokens)
            return await send_request(client, url, bodies[index], api == "chat", result, config.request_timeout, origin)

        if config.num_warmups:
            warm = await asyncio.gather(*(send(i % len(bodies), 0.0, 0.0) for i in range(config.num_warmups)))
            if not any(r.success for r in warm):
                print(f"warning: every warm-up request failed, e.g. {warm[0].error}", file=sys.stderr)
        progress = _progress(len(bodies), pattern.describe(), config.progress)
        try:
            return await run_load(pattern, len(bodies), send, seed=config.seed, on_done=lambda r: progress.update(1))
        finally:
            progress.close()


def _progress(total: int, description: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="req", file=sys.stderr, disable=not enabled, leave=False)


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main_serve(args) -> int:
    from tokenmill.bench.report import format_run, write_json

    config = BenchConfig.from_args(args)
    result = run_benchmark(config)
    print(format_run(result))
    if config.output:
        print(f"results: {write_json(config.output, result)}")
    return 0 if result["summary"]["completed"] else 1

