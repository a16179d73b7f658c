"""`tokenmill bench simulate`: a serving run replayed on paper against N replicas.

Each replica is the engine's own scheduler (`core.Scheduler` over a `KVCacheManager`, built as
`EngineCore` builds them) driven by a fake model: after each step, every request whose scheduled
tokens reach its last known token has sampled one token, as in `EngineCore.step`. So batching,
chunked prefill, the token budget, KV-block limits and preemption follow the engine's policy
exactly; only the forward pass is replaced, by a cost model of one step's time:

    t = a + b * prefill_tokens + c * decode_seqs + d * decode_context_tokens

A decode is a request the runner already holds scheduled for its one newest token (counted as
`EngineCore` counts them); `decode_context_tokens` sums the keys those decodes attend to; every
other scheduled token is a prefill token. `benchmarks/step_costs.py` fits a, b, c, d on a machine
by timing real engine steps and writes the JSON `--step-costs` reads.

Time is simulated. A replica with unfinished requests runs steps back to back; a request that
arrives during a step joins at the next one. An arriving request goes to the replica with the
fewest unfinished requests (ties: the lowest index). A token is delivered when the step that
sampled it ends, so TTFT = end of its first token's step - arrival, ITL = the gaps between its
tokens' steps, E2E = end of its last token's step - arrival, summarized by `metrics.summarize`
as `bench serve` summarizes what a client measures (here without network or detokenizer time).
Prompts are distinct (no prefix-cache hits) and EOS is ignored: every request produces exactly
its output tokens.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.client import RequestResult
from tokenmill.bench.datasets import DatasetError, LengthSpec
from tokenmill.bench.load import arrival_times
from tokenmill.bench.metrics import parse_percentiles, parse_slos, summarize
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import RequestRejectedError, Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams

RESULT_KIND = "tokenmill-bench-simulate"
STEP_COSTS_KIND = "tokenmill-step-costs"  # what benchmarks/step_costs.py writes
SAMPLED_TOKEN = 1  # what the fake model samples: no request stops on it (EOS is ignored)


class SimulationError(ValueError):
    """A bad trace, step-cost file or replica setting; the message names it."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's time depends on in the cost model."""

    prefill_tokens: int
    decode_seqs: int
    decode_context_tokens: int


def step_shape(sched: SchedulerOutput, requests: dict[str, Request]) -> StepShape:
    """The shape of a scheduled step (before `Scheduler.update`): decodes as `EngineCore.step`
    counts them, each attending to its computed tokens and its new one."""
    decode_seqs = context = 0
    for data in sched.scheduled_cached_reqs:
        if (sched.num_scheduled_tokens[data.req_id] == 1
                and data.num_computed_tokens >= requests[data.req_id].num_prompt_tokens):
            decode_seqs += 1
            context += data.num_computed_tokens + 1
    return StepShape(sched.total_num_scheduled_tokens - decode_seqs, decode_seqs, context)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one engine step: `a` per step, `b` per prefill token, `c` per decoding request,
    `d` per key a decode attends to."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value >= 0):
                raise SimulationError(f"step cost {name}: must be a finite number >= 0 (seconds), got {value!r}")
        if not any(dataclasses.astuple(self)):
            raise SimulationError("step costs: a, b, c and d are all 0; give --step-costs FILE or --step-a/-b/-c/-d")

    def seconds(self, shape: StepShape) -> float:
        return (self.a + self.b * shape.prefill_tokens + self.c * shape.decode_seqs
                + self.d * shape.decode_context_tokens)

    def describe(self) -> str:
        return (f"step = {self.a * 1e3:.4g} ms + {self.b * 1e6:.4g} us/prefill token + {self.c * 1e6:.4g} us/decode "
                f"+ {self.d * 1e9:.4g} ns/context token")


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica's scheduler limits, as the engine flags of the same names set them."""

    num_kv_blocks: int = 4096
    block_size: int = 16
    num_host_blocks: int = 0  # > 0: preempted requests are swapped out while they fit, else recomputed
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: room for the longest request of the workload

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if value is None and name == "max_model_len":
                continue
            least = 0 if name == "num_host_blocks" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SimulationError(f"replica {name}: must be an integer >= {least}, got {value!r}")


def load_step_costs(path: str | Path) -> tuple[StepCosts, dict]:
    """A step-cost file: `{"coefficients": {"a", "b", "c", "d"}, "replica": {ReplicaSpec fields}}`
    (the replica the costs were measured on; optional); other top-level keys are provenance."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SimulationError(f"step costs {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
        raise SimulationError(f"step costs {path}: expected a JSON object with a \"coefficients\" object")
    coefficients, replica = data["coefficients"], data.get("replica", {})
    if unknown := set(coefficients) - {"a", "b", "c", "d"}:
        raise SimulationError(f"step costs {path}: unknown coefficients {sorted(unknown)} (allowed: a, b, c, d)")
    fields = {f.name for f in dataclasses.fields(ReplicaSpec)}
    if not isinstance(replica, dict) or (unknown := set(replica) - fields):
        raise SimulationError(f"step costs {path}: \"replica\" must be an object with keys among {sorted(fields)}")
    return StepCosts(**coefficients), replica


# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    time: float  # arrival, seconds from the start of the trace
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if isinstance(self.time, bool) or not isinstance(self.time, (int, float)) or not (
                math.isfinite(self.time) and self.time >= 0):
            raise SimulationError(f"trace time: must be a finite number >= 0 (seconds), got {self.time!r}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SimulationError(f"trace {name}: must be an integer >= 1, got {value!r}")


def synthetic_trace(num_requests: int, request_rate: float, input_len: str, output_len: str,
                    seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `request_rate` (inf: all at 0), as `bench serve` releases them for the
    same seed, and lengths drawn from `LengthSpec`s (`N`, `MIN:MAX`, `normal:MEAN:STD`, `exp:MEAN`)."""
    if num_requests < 1:
        raise SimulationError(f"num_requests: must be >= 1, got {num_requests}")
    try:
        input_spec, output_spec = LengthSpec.parse(input_len), LengthSpec.parse(output_len)
    except DatasetError as e:
        raise SimulationError(str(e)) from None
    times = arrival_times(num_requests, request_rate, random.Random(seed))
    lengths = random.Random(seed + 1)
    prompts, outputs = input_spec.sample(lengths, num_requests), output_spec.sample(lengths, num_requests)
    return [TraceRequest(t, p, o) for t, p, o in zip(times, prompts, outputs)]


def read_trace(path: str | Path) -> list[TraceRequest]:
    """JSONL, one `{"time": SECONDS, "prompt_tokens": N, "output_tokens": N}` per line (blank
    lines skipped); requests are numbered in file order and may come in any time order."""
    trace = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or set(record) != {"time", "prompt_tokens", "output_tokens"}:
                raise SimulationError("expected an object with exactly time, prompt_tokens and output_tokens")
            trace.append(TraceRequest(**record))
        except (json.JSONDecodeError, SimulationError) as e:
            raise SimulationError(f"trace {path} line {number}: {e}") from None
    if not trace:
        raise SimulationError(f"trace {path}: no requests")
    return trace


def write_trace(path: str | Path, trace: list[TraceRequest]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in trace))
    return path


# -- the replicas ---------------------------------------------------------------------------------


class Replica:
    """One engine: its scheduler and its clock. A step in flight ends at `step_end`."""

    def __init__(self, spec: ReplicaSpec, max_model_len: int):
        kv = KVCacheManager(spec.num_kv_blocks, spec.block_size, num_host_blocks=spec.num_host_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(spec.max_num_batched_tokens, spec.max_num_seqs, max_model_len), kv)
        self.step: SchedulerOutput | None = None
        self.step_end = math.inf
        self.num_requests = 0
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.peak_kv_usage = 0.0

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    def start_step(self, now: float, costs: StepCosts) -> None:
        assert self.step is None and self.num_unfinished
        sched = self.scheduler.schedule()
        assert sched.total_num_scheduled_tokens > 0, "a replica with unfinished requests scheduled nothing"
        seconds = costs.seconds(step_shape(sched, self.scheduler.requests))
        self.step, self.step_end = sched, now + seconds
        self.num_steps += 1
        self.busy_seconds += seconds
        self.peak_kv_usage = max(self.peak_kv_usage, self.scheduler.kv.usage)

    def finish_step(self) -> list[EngineCoreOutput]:
        """The fake model's output: one token for every request the step brings to its last token."""
        sched, self.step, self.step_end = self.step, None, math.inf
        requests = self.scheduler.requests
        sampled = {req_id: [SAMPLED_TOKEN] for req_id, n in sched.num_scheduled_tokens.items()
                   if requests[req_id].num_computed_tokens + n >= requests[req_id].num_tokens}
        return self.scheduler.update(sched, ModelRunnerOutput(sampled_token_ids=sampled))

    def stats(self, duration: float) -> dict:
        return {
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "busy_s": self.busy_seconds,
            "utilization": self.busy_seconds / duration if duration > 0 else None,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swap_preemptions": self.scheduler.num_swap_preemptions,
            "peak_kv_usage": self.peak_kv_usage,
        }


def _request(index: int, r: TraceRequest) -> Request:
    # a distinct first token per request: no prompt shares a cached block with another
    params = SamplingParams(max_tokens=r.output_tokens, ignore_eos=True)
    prompt = [SAMPLED_TOKEN + 1 + index] + [0] * (r.prompt_tokens - 1)
    return Request(str(index), prompt, params, eos_token_ids=[], max_tokens=r.output_tokens, arrival_time=r.time)


@dataclass
class Simulation:
    results: list[RequestResult]  # one per trace request, in trace order
    duration: float  # first arrival to last completion (0 if none completed)
    replicas: list[dict]  # Replica.stats per replica


def simulate(trace: list[TraceRequest], costs: StepCosts, spec: ReplicaSpec = ReplicaSpec(),
             num_replicas: int = 1) -> Simulation:
    if num_replicas < 1:
        raise SimulationError(f"num_replicas: must be >= 1, got {num_replicas}")
    if not trace:
        raise SimulationError("trace: no requests")
    max_model_len = spec.max_model_len or max(r.prompt_tokens + r.output_tokens for r in trace)
    replicas = [Replica(spec, max_model_len) for _ in range(num_replicas)]
    results = [RequestResult(index=i, scheduled_time=r.time, start_time=r.time, max_tokens=r.output_tokens,
                             prompt_tokens=r.prompt_tokens, usage_reported=True) for i, r in enumerate(trace)]
    token_times: dict[int, list[float]] = {}
    arrivals = deque(sorted(range(len(trace)), key=lambda i: trace[i].time))
    while arrivals or any(replica.num_unfinished for replica in replicas):
        next_arrival = trace[arrivals[0]].time if arrivals else math.inf
        now = min(next_arrival, *(replica.step_end for replica in replicas))
        # 1. steps that end now deliver their tokens (and free their finished requests' blocks)
        for replica in replicas:
            if replica.step_end == now:
                for out in replica.finish_step():
                    index = int(out.req_id)
                    token_times[index].extend([now] * len(out.new_token_ids))
                    if out.finished:
                        _complete(results[index], token_times.pop(index), out.finish_reason)
        # 2. arrivals up to now go to the least loaded replica
        while arrivals and trace[arrivals[0]].time <= now:
            index = arrivals.popleft()
            replica = min(replicas, key=lambda r: r.num_unfinished)
            try:
                replica.scheduler.add_request(_request(index, trace[index]))
            except RequestRejectedError as e:
                results[index].error = f"rejected: {e}"
                continue
            replica.num_requests += 1
            token_times[index] = []
        # 3. idle replicas with work start their next step
        for replica in replicas:
            if replica.step is None and replica.num_unfinished:
                replica.start_step(now, costs)
    assert not token_times, "every admitted request finished"
    done = [r for r in results if r.success]
    duration = max(r.start_time + r.e2e for r in done) - min(r.time for r in trace) if done else 0.0
    return Simulation(results, duration, [replica.stats(duration) for replica in replicas])


def _complete(result: RequestResult, times: list[float], finish_reason: str) -> None:
    arrival = result.start_time
    result.success = True
    result.finish_reason = finish_reason
    result.output_tokens = result.num_output_events = len(times)
    result.ttft, result.e2e = times[0] - arrival, times[-1] - arrival
    result.itl = [b - a for a, b in zip(times, times[1:])]


# -- the command ----------------------------------------------------------------------------------


@dataclass
class SimConfig:
    """Every `bench simulate` flag, one field each (None: from the step-cost file, else the default)."""

    # the workload
    trace: str | None = None
    num_requests: int = 100
    request_rate: float = math.inf
    input_len: str = "256"
    output_len: str = "128"
    seed: int = 0
    save_trace: str | None = None
    # the replicas
    num_replicas: int = 1
    step_costs: str | None = None
    step_a: float | None = None
    step_b: float | None = None
    step_c: float | None = None
    step_d: float | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    num_host_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    # the report
    percentiles: str = "50,90,99"
    slo: str | None = None
    cost_per_hour: float | None = None
    label: str | None = None
    output: str | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise SimulationError(f"num_replicas: must be >= 1, got {self.num_replicas}")
        if self.cost_per_hour is not None and self.cost_per_hour < 0:
            raise SimulationError(f"cost_per_hour: must be >= 0, got {self.cost_per_hour}")
        parse_percentiles(self.percentiles)
        parse_slos(self.slo)
        _ = self.costs_and_replica  # a bad file or flag fails before the run

    @classmethod
    def from_args(cls, args) -> SimConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @property
    def costs_and_replica(self) -> tuple[StepCosts, ReplicaSpec]:
        costs, replica = load_step_costs(self.step_costs) if self.step_costs else (None, {})
        flags = {"a": self.step_a, "b": self.step_b, "c": self.step_c, "d": self.step_d}
        base = dataclasses.asdict(costs) if costs else {}
        costs = StepCosts(**{**base, **{k: v for k, v in flags.items() if v is not None}})
        overrides = {f.name: getattr(self, f.name) for f in dataclasses.fields(ReplicaSpec)}
        replica = ReplicaSpec(**{**replica, **{k: v for k, v in overrides.items() if v is not None}})
        return costs, replica

    def workload(self) -> list[TraceRequest]:
        if self.trace:
            return read_trace(self.trace)
        return synthetic_trace(self.num_requests, self.request_rate, self.input_len, self.output_len, self.seed)

    def describe_load(self) -> str:
        if self.trace:
            return f"trace {Path(self.trace).name}"
        arrivals = "burst" if math.isinf(self.request_rate) else f"Poisson {self.request_rate:g} req/s"
        return f"{arrivals}, prompts {self.input_len}, outputs {self.output_len} tokens"


def run_simulation(config: SimConfig, trace: list[TraceRequest] | None = None) -> dict:
    """One simulated run as a JSON-ready dict: config, step costs, replica, summary, per-replica
    stats and every request's samples (the fields of a `bench serve` result where they apply)."""
    costs, replica = config.costs_and_replica
    trace = trace if trace is not None else config.workload()
    sim = simulate(trace, costs, replica, config.num_replicas)
    total_cost = None if config.cost_per_hour is None else config.cost_per_hour * config.num_replicas
    summary = summarize(sim.results, sim.duration, parse_percentiles(config.percentiles), parse_slos(config.slo),
                        total_cost)
    return {
        "kind": RESULT_KIND,
        "format_version": 1,
        "label": config.label or f"{config.num_replicas} replica{'s' if config.num_replicas > 1 else ''}",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load": config.describe_load(),
        "config": {**dataclasses.asdict(config),
                   "request_rate": None if math.isinf(config.request_rate) else config.request_rate},
        "step_costs": dataclasses.asdict(costs),
        "replica": dataclasses.asdict(replica),
        "summary": summary,
        "replicas": sim.replicas,
        "requests": [r.to_dict() for r in sim.results],
    }


def format_simulation(result: dict) -> str:
    from tokenmill.bench.report import format_summary

    cfg, rep = result["config"], result["replica"]
    costs = StepCosts(**result["step_costs"])
    price = f" at ${cfg['cost_per_hour']:g}/h each" if cfg["cost_per_hour"] is not None else ""
    lines = [
        f"tokenmill bench simulate: {result['label']}",
        f"{cfg['num_replicas']} x replica{price} ({rep['num_kv_blocks']} KV blocks x {rep['block_size']} tokens, "
        f"{rep['num_host_blocks']} host blocks, {rep['max_num_batched_tokens']} tokens and {rep['max_num_seqs']} "
        f"requests per step) · {result['load']}",
        costs.describe(),
    ]
    lines += format_summary(result["summary"])
    lines.append(f"{'replica':<10}{'requests':>10}{'steps':>10}{'busy':>8}{'preempted':>11}{'peak KV':>9}")
    for i, r in enumerate(result["replicas"]):
        busy = "-" if r["utilization"] is None else f"{100 * r['utilization']:.0f}%"
        lines.append(f"{i:<10}{r['num_requests']:>10}{r['num_steps']:>10}{busy:>8}{r['num_preemptions']:>11}"
                     f"{100 * r['peak_kv_usage']:>8.0f}%")
    lines.append("-" * 72)
    return "\n".join(lines)


def main_simulate(args) -> int:
    from tokenmill.bench.report import write_json

    config = SimConfig.from_args(args)
    trace = config.workload()
    if config.save_trace:
        print(f"trace: {write_trace(config.save_trace, trace)}")
    result = run_simulation(config, trace)
    print(format_simulation(result))
    if config.output:
        print(f"results: {write_json(config.output, result)}")
    return 0 if result["summary"]["completed"] else 1
