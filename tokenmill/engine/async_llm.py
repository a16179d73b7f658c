"""The engine for online serving: `LLMEngine` stepping on its own thread, asyncio in front.

The event-loop thread tokenizes and validates new requests (`LLMEngine.prepare_request` reads
only the tokenizer, the config and the grammar cache; a structured-output constraint is compiled
on a worker thread first) and hands them, and aborts, to the engine thread through a
command queue. The engine thread applies the commands between iterations, runs one step at a
time, and posts each step's outputs back to the loop in one callback, where they are routed to
per-request queues. The loop never waits on a model step, so HTTP handling and tokenization
overlap with the matmuls (which release the GIL).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.config import EngineConfig
from tokenmill.engine.engine_core import MAX_PERSIST_SECONDS
from tokenmill.engine.llm_engine import LLMEngine, Prompt
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutdown)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error, or one step ran past the watchdog's
    limit (a wedged engine); no request can make progress."""


@dataclass
class EngineStats:
    """A snapshot for metrics and the periodic log; cumulative fields only ever grow."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    num_blocks: int = 0  # KV blocks on the device, and how many are free (cached prefixes count as free)
    num_free_blocks: int = 0
    num_host_blocks: int = 0  # host blocks for swapping, and how many are free
    num_free_host_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefill, including recomputation)
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of which found (not computed)
    prefix_cache_evictions: int = 0  # cached blocks reused for other contents
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    bytes_per_block: int = 0
    # Prefix-cache tiers, per tier (device, host, disk), in blocks: lookups found and not found
    # (disk: reads that delivered a block and reads that failed), blocks held and the most held;
    # blocks promoted (host -> device), demoted (device -> host), written to and read from disk,
    # files found torn or corrupted, and the disk threads' seconds spent writing and reading.
    tier_hits: tuple[int, int, int] = (0, 0, 0)
    tier_misses: tuple[int, int, int] = (0, 0, 0)
    tier_blocks: tuple[int, int, int] = (0, 0, 0)
    tier_capacity_blocks: tuple[int, int, int] = (0, 0, 0)
    num_promoted_blocks: int = 0
    num_demoted_blocks: int = 0
    num_disk_written_blocks: int = 0
    num_disk_read_blocks: int = 0
    num_disk_corrupt_blocks: int = 0
    disk_write_seconds: float = 0.0
    disk_read_seconds: float = 0.0
    # Speculative decoding: verifications (one request verifying drafts in one step), draft
    # tokens, accepted drafts, and accepted drafts by position (0 = the first draft).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


class StepRecord(NamedTuple):
    """One engine step, as the live stats stream shows it."""

    step: int  # 1 = the engine's first step
    end_time: float  # time.monotonic() when the step returned
    seconds: float
    num_prefill_tokens: int  # prompt tokens computed (recomputation after preemption included)
    num_generated_tokens: int


# Steps kept in `AsyncLLM.recent_steps`: seconds of history at any step rate the engine reaches.
NUM_RECENT_STEPS = 4096


class _Failed:
    """Posted to a request's queue when the engine could not take it or died."""

    def __init__(self, error: BaseException):
        self.error = error


class RequestStream:
    """The outputs of one request: one RequestOutput per engine iteration in which it
    progressed, the last with `finished`. `abort()` (or leaving early through `aclose()`) stops
    the request before the engine's next step and frees its KV blocks."""

    def __init__(self, llm: "AsyncLLM", request_id: str, q: asyncio.Queue):
        self.llm = llm
        self.request_id = request_id
        self._queue = q
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        failed = isinstance(item, _Failed)
        if failed or item.finished:
            self.finished = True
            self.llm._release(self.request_id, abort=False)
        if failed:
            raise item.error
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.llm._release(self.request_id, abort=True)

    async def aclose(self) -> None:
        self.abort()


class AsyncLLM:
    """Call `start()` (loads the model on the engine thread) from inside a running event loop,
    then `add_request()` from any coroutine on that loop.

    Failure contract: if a step raises, or one step runs longer than `step_timeout` seconds
    (a watchdog on the event loop checks; None = no limit), the engine is dead for good:
    `dead_error` is set, `dead` fires, every unfinished request's stream raises
    EngineDeadError at once, and `add_request` raises it from then on. A stalled step is
    never waited for; its outputs, if it ever returns, are dropped."""

    def __init__(self, config: EngineConfig, log_stats_interval: float = 10.0, step_timeout: float | None = None):
        self.config = config
        self.log_stats_interval = log_stats_interval
        self.step_timeout = step_timeout
        self.engine: LLMEngine | None = None
        self.ready = asyncio.Event()
        self.load_error: BaseException | None = None
        self.dead_error: BaseException | None = None
        self.dead = asyncio.Event()
        self._step_started: float | None = None  # monotonic start of the step running now
        self._watchdog: asyncio.Future | None = None
        self.stats = EngineStats()
        # The last NUM_RECENT_STEPS steps, appended by the engine thread (one tuple a step, nothing
        # else). Readers on other threads take a copy first (`list(...)` holds the GIL throughout).
        self.recent_steps: deque[StepRecord] = deque(maxlen=NUM_RECENT_STEPS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._thread: threading.Thread | None = None
        self._stop = False

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()
        if self.step_timeout is not None:
            self._watchdog = asyncio.ensure_future(self._watch_steps(self.step_timeout))

    async def wait_ready(self) -> LLMEngine:
        await self.ready.wait()
        if self.load_error is not None:
            raise self.load_error
        return self.engine

    def shutdown(self, timeout: float = 10.0 + MAX_PERSIST_SECONDS) -> None:
        """Stop the engine thread after its step, waiting up to `timeout` seconds for it (and for
        the prefix cache's blocks it writes to disk at shutdown)."""
        self._stop = True
        self._commands.put(None)  # wake the thread if it is idle
        if self._thread is not None and self.dead_error is None:  # a wedged thread is not waited for
            self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (as the event loop sees them)."""
        return len(self._queues)

    # -- requests -------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, chat: bool = False) -> RequestStream:
        """Tokenize, validate and queue a request; bad input raises here (a ValueError naming
        the field) and queues nothing. Iterate the returned stream for its outputs."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead_error!r}")
        engine = await self.wait_ready()
        if params.structured_output is not None:
            # Compile on a worker thread (xgrammar releases the GIL): neither this event loop nor
            # the engine thread waits for it; prepare_request then finds it in the cache.
            await asyncio.to_thread(engine.grammar_compiler.compile, params.structured_output)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        prepared = engine.prepare_request(request_id, prompt, params, chat)
        if self.dead_error is not None:  # it may have died while we awaited: its queues are failed already
            raise EngineDeadError(f"the engine stopped: {self.dead_error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._commands.put(("add", prepared))
        return RequestStream(self, request_id, q)

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Abort every request; each one's stream raises RequestAbortedError."""
        for request_id, q in list(self._queues.items()):
            q.put_nowait(_Failed(RequestAbortedError(reason)))
            self._commands.put(("abort", request_id))

    def _release(self, request_id: str, abort: bool) -> None:
        self._queues.pop(request_id, None)
        if abort:
            self._commands.put(("abort", request_id))  # applied before the engine's next step

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as e:  # noqa: BLE001 - reported to every caller of wait_ready
            logger.exception("loading the model failed")
            self.load_error = e
            self._loop.call_soon_threadsafe(self.ready.set)
            return
        engine = self.engine
        self._refresh_gauges(engine)
        self._loop.call_soon_threadsafe(self.ready.set)
        last_log = time.monotonic()
        logged = EngineStats()
        try:
            while not self._stop and self.dead_error is None:
                engine.core.check_health()  # a rank that exited, even while idle
                block = not engine.has_unfinished_requests()
                self._apply_commands(engine, block)
                if self._stop:
                    break
                self._refresh_gauges(engine)  # aborts free blocks even when no step follows
                if engine.has_unfinished_requests():
                    started = self._step_started = time.monotonic()
                    outputs = engine.step()
                    self._step_started = None
                    if self.dead_error is not None:
                        break  # the watchdog gave up on this step: its requests were failed already
                    self._count_step(engine, started)
                    self._refresh_gauges(engine)
                    if outputs:
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)
                now = time.monotonic()
                if self.log_stats_interval > 0 and now - last_log >= self.log_stats_interval:
                    self._log_stats(logged, now - last_log)
                    logged, last_log = _copy(self.stats), now
        except BaseException as e:  # noqa: BLE001 - fail every request rather than hang them
            self._step_started = None
            logger.exception("engine step failed; the engine is stopped")
            self._loop.call_soon_threadsafe(self._die, e)
        finally:
            engine.core.shutdown()

    async def _watch_steps(self, timeout: float) -> None:
        """Declare the engine dead when one step has run for more than `timeout` seconds."""
        while self.dead_error is None and not self._stop:
            await asyncio.sleep(min(0.25, timeout / 4))
            started = self._step_started
            if started is not None and time.monotonic() - started > timeout:
                logger.error("an engine step has run for more than %gs; the engine is stopped", timeout)
                self._die(TimeoutError(f"an engine step ran for more than {timeout:g}s"))

    def _apply_commands(self, engine: LLMEngine, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if command is None:
                continue
            kind, arg = command
            if kind == "add":
                try:
                    engine.add_prepared(arg)
                except ValueError as e:  # e.g. needs more KV blocks than exist
                    self._loop.call_soon_threadsafe(self._post, arg.request_id, _Failed(e))
            else:
                engine.abort_request([arg])

    def _refresh_gauges(self, engine: LLMEngine) -> None:
        core = engine.core
        s = self.stats
        s.num_running = len(core.scheduler.running)
        s.num_waiting = len(core.scheduler.waiting)
        s.kv_cache_usage = core.kv_cache_manager.usage
        s.num_preemptions = core.scheduler.num_preemptions
        kv = core.kv_cache_manager
        s.num_blocks, s.num_free_blocks = kv.block_pool.num_blocks, kv.num_free_blocks
        if kv.host_pool is not None:
            s.num_host_blocks, s.num_free_host_blocks = kv.host_pool.num_blocks, kv.host_pool.num_free_blocks
        s.prefix_cache_queries = kv.prefix_query_tokens
        s.prefix_cache_hits = kv.prefix_hit_tokens
        s.prefix_cache_evictions = kv.block_pool.num_evictions
        s.num_swapped_out_blocks = kv.num_swapped_out_blocks
        s.num_swapped_in_blocks = kv.num_swapped_in_blocks
        s.bytes_per_block = core.runner.bytes_per_block
        self._refresh_tiers(kv, core.runner.disk_store)
        sched = core.scheduler
        s.spec_drafts = sched.num_spec_drafts
        s.spec_draft_tokens = sched.num_spec_draft_tokens
        s.spec_accepted_tokens = sched.num_spec_accepted_tokens
        s.spec_accepted_per_position = tuple(sched.spec_accepted_per_position)

    def _refresh_tiers(self, kv, disk) -> None:
        s = self.stats
        host, index = kv.host_tier, kv.disk_index
        s.tier_hits = (kv.device_hit_blocks, kv.host_hit_blocks, kv.disk_hit_blocks)
        s.tier_misses = (kv.device_miss_blocks, kv.host_miss_blocks, kv.disk_miss_blocks)
        s.tier_blocks = (len(kv.block_pool.cached), host.num_cached if host else 0, len(index) if index else 0)
        s.tier_capacity_blocks = (kv.block_pool.num_blocks, host.num_slots if host else 0,
                                  index.max_blocks if index else 0)
        s.num_promoted_blocks, s.num_demoted_blocks = kv.num_promoted_blocks, kv.num_demoted_blocks
        if disk is not None:
            s.num_disk_written_blocks, s.num_disk_read_blocks = disk.num_written, disk.num_read
            s.num_disk_corrupt_blocks = disk.num_corrupt
            s.disk_write_seconds, s.disk_read_seconds = disk.write_seconds, disk.read_seconds

    def _count_step(self, engine: LLMEngine, started: float) -> None:
        s = self.stats
        prefill, generated = engine.core.last_num_prompt_tokens, engine.core.last_num_generated_tokens
        s.num_steps += 1
        s.num_prompt_tokens += prefill
        s.num_generation_tokens += generated
        now = time.monotonic()
        self.recent_steps.append(StepRecord(s.num_steps, now, now - started, prefill, generated))

    def _log_stats(self, last: EngineStats, elapsed: float) -> None:
        s = self.stats
        queries = s.prefix_cache_queries - last.prefix_cache_queries
        hits = s.prefix_cache_hits - last.prefix_cache_hits
        logger.info(
            "engine: %d running, %d waiting, KV cache %.1f%% used, prompt %.1f tok/s, generation %.1f tok/s, "
            "prefix cache hit rate %.1f%%, %d preemptions, %d blocks swapped out",
            s.num_running, s.num_waiting, 100 * s.kv_cache_usage,
            (s.num_prompt_tokens - last.num_prompt_tokens) / elapsed,
            (s.num_generation_tokens - last.num_generation_tokens) / elapsed,
            100 * hits / queries if queries else 0.0, s.num_preemptions, s.num_swapped_out_blocks,
        )
        drafts = s.spec_drafts - last.spec_drafts
        if drafts:
            draft_tokens = s.spec_draft_tokens - last.spec_draft_tokens
            accepted = s.spec_accepted_tokens - last.spec_accepted_tokens
            logger.info(
                "speculative decoding: %d verifications, mean accepted length %.2f (of %.2f drafts), "
                "acceptance rate %.1f%%",
                drafts, 1 + accepted / drafts, draft_tokens / drafts, 100 * accepted / draft_tokens,
            )

    # -- on the event loop ----------------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._post(out.request_id, out)

    def _post(self, request_id: str, item) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(item)

    def _die(self, error: BaseException) -> None:
        """The engine is dead: fail every unfinished request now (on the event loop)."""
        if self.dead_error is not None:
            return
        self.dead_error = error
        dead = EngineDeadError(f"the engine stopped: {error!r}")
        for q in self._queues.values():
            q.put_nowait(_Failed(dead))
        self.dead.set()


def _copy(stats: EngineStats) -> EngineStats:
    return EngineStats(**vars(stats))
