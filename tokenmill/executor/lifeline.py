"""A worker rank's tie to the engine process that started it (multiproc.py: WorkerProcess): the
worker ends when that process ends, however it ends (an exit, an uncaught exception, SIGTERM,
SIGKILL) and whatever the worker is doing (starting, loading, waiting for a step, inside a
collective), so it never keeps running, nor keeps its parent's stdout or stderr open, after it.

Three ties, any of which ends the worker:
- its stdin: the parent writes the worker's arguments there and keeps the pipe open for the
  worker's whole life; the kernel closes it when the parent's process ends, and a watchdog thread
  waiting on it sees end-of-file at once;
- its parent's pid, which the same thread compares every POLL_SECONDS (another process may hold
  the pipe's write end too: a child the parent forked);
- on Linux, PR_SET_PDEATHSIG: the kernel sends SIGKILL when the parent's thread that spawned the
  worker ends. Asked for only when that thread is the parent's main thread, whose end is the
  process's end: an engine built on a short-lived thread must not lose its ranks with it.

Only the standard library is imported here: `python -m tokenmill.executor` ties the worker to its
parent before torch is imported (which takes seconds on a small machine).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import struct
import sys
import threading
from typing import BinaryIO

POLL_SECONDS = 0.25
ORPHANED_EXIT_CODE = 1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LENGTH = struct.Struct("<Q")


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    """The parent's side: `payload`, length first, flushed (the stream stays open)."""
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def attach(parent_pid: int, pdeathsig: bool, fd: int = 0) -> bytes:
    """The worker's side, first thing in its process: tie it to `parent_pid` (the ties above), and
    return the payload the parent wrote to `fd` (its stdin). The process exits at once if the
    parent is already gone."""
    if pdeathsig and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the line above
        exit_orphaned()
    header = _read_exactly(fd, _LENGTH.size)
    payload = None if header is None else _read_exactly(fd, _LENGTH.unpack(header)[0])
    if payload is None:
        exit_orphaned()
    threading.Thread(target=_watch, args=(parent_pid, fd), name="tokenmill-lifeline", daemon=True).start()
    return payload


def _watch(parent_pid: int, fd: int) -> None:
    while True:
        readable, _, _ = select.select([fd], [], [], POLL_SECONDS)
        if readable and not os.read(fd, 4096):  # end-of-file (the parent writes nothing more)
            break
        if os.getppid() != parent_pid:
            break
    exit_orphaned()


def exit_orphaned() -> None:
    """End this process now, from any thread, whatever the others are doing."""
    try:
        os.write(2, f"tokenmill worker pid {os.getpid()}: the engine's process exited; exiting\n".encode())
    except OSError:  # nobody reads stderr any more
        pass
    os._exit(ORPHANED_EXIT_CODE)
