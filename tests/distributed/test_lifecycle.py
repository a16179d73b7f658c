"""An engine split over ranks gives back its worker processes and its process group on every
path: `with`, `del`, `shutdown()`, the interpreter's exit, a start that raises (a config error on
every rank, Ctrl-C on rank 0 alone), and the death of its process by SIGKILL or SIGTERM while the
workers load, wait for a step or run one. Engines of other shapes then follow one another in one
process with the tokens of one process.

Each scenario is a Python process of its own (SCRIPT, on the tiny Qwen2), its stdout a pipe read
to its end (a worker that outlived it would hold the pipe open); its workers are found by the
parent pid on their command line (`python -m tokenmill.executor PARENT_PID`)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.distributed.test_parallel import ENGINE, PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.distributed.shm import shm_dir

REPO = Path(__file__).resolve().parents[2]
GONE_SECONDS = 3.0  # a worker whose engine's process is gone exits within this (its contract: 2 s)
RUN_SECONDS = 180  # a whole scenario, on 2 busy cores
MAX_TOKENS = 8

SCRIPT = """
import json, os, signal, sys, threading, time
import psutil
from tokenmill import LLM, SamplingParams

MODEL, ENGINE, PROMPTS, SCENARIO = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
GREEDY = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]), ignore_eos=True)
ME = psutil.Process()

def workers():
    found = []
    for p in ME.children():
        try:
            if "tokenmill.executor" in p.cmdline():
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found

def report(**fields):
    print(json.dumps(fields), flush=True)

def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]

def shm_files():  # this process's shared-memory files (executor/multiproc.py names them by pid)
    from tokenmill.distributed.shm import shm_dir
    return [f.name for f in shm_dir().glob(f"tokenmill-allreduce-{os.getpid()}-*")]

if SCENARIO == "sequence":
    with LLM(MODEL, tensor_parallel_size=2, **ENGINE) as llm:
        first = workers()
        try:
            LLM(MODEL, pipeline_parallel_size=2, **ENGINE)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        report(split="tp2", tokens=tokens(llm), workers=first, refused=refused, workers_after_refusal=workers(),
               shm=shm_files())
    report(split="tp2", left=workers(), shm=shm_files())
    llm = LLM(MODEL, pipeline_parallel_size=2, **ENGINE)
    report(split="pp2", tokens=tokens(llm), workers=workers())
    del llm
    report(split="pp2", left=workers(), shm=shm_files())
    llm = LLM(MODEL, **ENGINE)
    report(split="tp1", tokens=tokens(llm), workers=workers())
    llm.shutdown()
    llm.shutdown()

elif SCENARIO == "exit":  # built on a thread that has ended, never shut down: the interpreter's exit releases it
    built = []
    builder = threading.Thread(target=lambda: built.append(LLM(MODEL, tensor_parallel_size=2, **ENGINE)))
    builder.start()
    builder.join()
    llm = built[0]
    report(workers=workers(), tokens=tokens(llm))

elif SCENARIO == "failed-start":
    from tokenmill.config import ConfigError
    seen = []
    def watch():  # what the start spawned before it raised
        while not seen:
            seen.extend(workers())
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    try:  # every rank refuses this in its ModelRunner, after the workers have joined the group
        LLM(MODEL, tensor_parallel_size=2, kv_cache_dtype="float16", **{**ENGINE, "dtype": "bfloat16"})
    except ConfigError as e:
        report(case="config error", error=str(e), seen=list(seen), left=workers())
    seen.clear()
    # Ctrl-C raises KeyboardInterrupt even where this process was started with SIGINT ignored (a
    # background job of a shell inherits that, and passes it on to its children)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    def interrupt():  # Ctrl-C while the workers start (rank 0 waits for them to join): rank 0 alone raises
        while not seen:
            seen.extend(workers())
            time.sleep(0.01)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        LLM(MODEL, pipeline_parallel_size=2, **ENGINE)
        report(case="interrupt", error=None)
    except KeyboardInterrupt:
        report(case="interrupt", error="KeyboardInterrupt", seen=list(seen), left=workers())
    with LLM(MODEL, tensor_parallel_size=2, **ENGINE) as llm:
        report(case="after", tokens=tokens(llm))

else:  # SCENARIO: "<signal> <phase>": this process dies by the signal while its workers are in the phase
    sig, phase = signal.Signals[SCENARIO.split()[0]], SCENARIO.split()[1]
    die = lambda: os.kill(os.getpid(), sig)
    if phase == "start":  # the workers are loading (importing torch, joining the group)
        def kill_when_spawned():
            while not (found := workers()):
                time.sleep(0.01)
            report(workers=found)
            time.sleep(1.0)
            die()
        threading.Thread(target=kill_when_spawned, daemon=True).start()
        LLM(MODEL, tensor_parallel_size=2, **ENGINE)
    else:
        llm = LLM(MODEL, tensor_parallel_size=2, **ENGINE)
        report(workers=workers())
        if phase == "idle":  # the workers wait for the next step
            die()
        else:  # "step": the workers are inside steps (collectives, the step mailbox)
            threading.Timer(0.5, die).start()
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
    time.sleep(60)
    report(error="still alive")
"""


def _workers_of(pid: int) -> list[psutil.Process]:
    """The running worker processes that process `pid` started, even after it is gone."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if ("tokenmill.executor" in cmd and cmd[cmd.index("tokenmill.executor") + 1:][:1] == [str(pid)]
                and p.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(p)
    return found


def _running(pid: int) -> bool:
    """Whether process `pid` has not exited yet (an exiting process loses its command line first)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(parent_pid: int, pids: list[int], seconds: float) -> list[int]:
    """The workers of `parent_pid`, and those of `pids`, still running after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        left = sorted({p.pid for p in _workers_of(parent_pid)} | {pid for pid in pids if _running(pid)})
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


class Scenario:
    """SCRIPT running one scenario; `kill_leftovers` ends whatever workers it left (after a failure)."""

    def __init__(self, model: Path, scenario: str, stderr_path: Path):
        self.stderr_path = stderr_path
        self.stderr = stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(model), json.dumps(ENGINE), json.dumps(PROMPTS), scenario, str(MAX_TOKENS)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=self.stderr, text=True)

    def read_report(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"no report; stderr:\n{self.log()}"
        return json.loads(line)

    def communicate(self) -> list[dict]:
        """Every report to the end of stdout, which comes once nothing holds the pipe any more."""
        out, _ = self.proc.communicate(timeout=RUN_SECONDS)
        return [json.loads(line) for line in out.splitlines()]

    def log(self) -> str:
        return self.stderr_path.read_text()[-4000:]

    def kill_leftovers(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for p in _workers_of(self.proc.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self.stderr.close()


@pytest.fixture
def scenario(tiny_qwen2_dir, tmp_path):
    started: list[Scenario] = []

    def start(name: str) -> Scenario:
        started.append(Scenario(tiny_qwen2_dir, name, tmp_path / f"stderr-{len(started)}.log"))
        return started[-1]

    yield start
    for s in started:
        s.kill_leftovers()


@pytest.fixture(scope="module")
def one_process_tokens(tiny_qwen2_dir):
    with LLM(str(tiny_qwen2_dir), **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                                     ignore_eos=True))]


def test_engines_of_every_shape_follow_one_another_in_one_process(scenario, one_process_tokens):
    """tp=2 in `with`, pp=2 let go by `del`, then one process: each gives back its workers and its
    group when it is released, and each produces the tokens of one process."""
    s = scenario("sequence")
    tp2, tp2_after, pp2, pp2_after, tp1 = s.communicate()
    assert s.proc.returncode == 0, s.log()
    assert len(tp2["workers"]) == 1 and len(pp2["workers"]) == 1 and tp1["workers"] == []
    assert tp2["tokens"] == pp2["tokens"] == tp1["tokens"] == one_process_tokens
    # A second split engine while the first is open is refused before it starts anything.
    assert "already has a torch.distributed process group" in tp2["refused"]
    assert tp2["workers_after_refusal"] == tp2["workers"]
    assert tp2_after["left"] == [] and pp2_after["left"] == []  # gone when `with` ends and at `del`
    assert tp2["shm"] == tp2_after["shm"] == pp2_after["shm"] == []  # no shared-memory file outlives the start


def test_interpreter_exit_stops_the_workers_of_an_engine_never_shut_down(scenario):
    """Built on a thread that has ended before it generates (its workers must not end with that
    thread), and never shut down."""
    s = scenario("exit")
    (report,) = s.communicate()
    assert s.proc.returncode == 0, s.log()
    assert len(report["workers"]) == 1 and len(report["tokens"]) == len(PROMPTS)
    assert _wait_gone(s.proc.pid, report["workers"], 0.0) == []


def test_a_start_that_raises_leaves_no_worker_and_the_next_engine_starts(scenario, one_process_tokens):
    s = scenario("failed-start")
    config_error, interrupted, after = s.communicate()
    assert s.proc.returncode == 0, s.log()
    assert "kv_cache_dtype" in config_error["error"]
    assert interrupted["error"] == "KeyboardInterrupt", s.log()
    for case in (config_error, interrupted):
        assert case["seen"] and case["left"] == [], case  # workers were spawned, none is left
    assert after["tokens"] == one_process_tokens


@pytest.mark.parametrize("how", ["SIGKILL start", "SIGKILL idle", "SIGKILL step", "SIGTERM step"])
def test_workers_die_with_the_engine_process(scenario, how):
    """However the engine's process dies and whatever its workers are doing, they exit within
    GONE_SECONDS, and a reader of its stdout reaches the end (no worker holds the pipe)."""
    s = scenario(how)
    report = s.read_report()
    assert len(report["workers"]) == 1
    s.proc.wait(timeout=RUN_SECONDS)
    died = time.monotonic()
    assert s.proc.returncode == -signal.Signals[how.split()[0]], s.log()
    try:
        s.proc.communicate(timeout=GONE_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the engine's stdout is still held open {GONE_SECONDS}s after it died, workers "
                    f"{[p.pid for p in _workers_of(s.proc.pid)]} running; stderr:\n{s.log()}")
    left = _wait_gone(s.proc.pid, report["workers"], max(0.0, GONE_SECONDS - (time.monotonic() - died)))
    assert left == [], f"workers {left} outlived their engine; stderr:\n{s.log()}"
    assert not list(shm_dir().glob(f"tokenmill-allreduce-{s.proc.pid}-*"))  # nor its shared-memory files
