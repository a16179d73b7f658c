"""The prefix cache's disk tier: one file per KV block, written from and read into the host
tier's slots by two background threads, so the step loop never waits on the disk.

Files live in `<disk_cache_dir>/<identity>/<block hash>.kv`. The identity (`cache_identity`) is
a SHA-256 of everything that decides a block's bytes besides its tokens: the model's files, its
shape, dtype, quantization, KV-cache dtype, block size and the tensors' layout, and the file
format. The block hash chain itself (`core/block_pool.hash_block`, SHA-256 of the token ids and
the parent's hash) is the same in every process, so a later engine with the same identity finds
a prefix's blocks, and an engine with another identity looks in another folder (and a file that
found its way there is refused by the identity in its header).

A file is a header (magic, identity, block hash, payload length, CRC-32 of the payload) and the
block's bytes: every tensor of every layer of the host cache at that slot, in order. It is
written to a temporary name in the same folder and renamed, so a reader sees a whole file or
none; a file torn by a crash (no fsync: the rename may reach the disk before the data) or
corrupted later fails its checksum, is counted, deleted and read as a miss. A write that fails
(a full disk, an unwritable folder) logs one warning and turns the tier off (`enabled`); the
engine then stops asking for it and serving goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from pathlib import Path

import torch

from tokenmill.layers.attention.kv_quant import indexable

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"TMKVBLK1"
_HEADER = struct.Struct("<8s32s32sQI")  # magic, identity, block hash, payload bytes, CRC-32 of the payload
SUFFIX = ".kv"

KVCache = tuple[torch.Tensor, ...]


def cache_identity(fields: dict) -> bytes:
    """The SHA-256 of `fields` (JSON-serializable: whatever decides a block's bytes) and the
    file format."""
    text = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


class DiskBlockStore:
    """Block files of one identity under `directory`, at most `max_bytes` of them (the KV-cache
    manager's `DiskIndex` keeps the bound and says what to delete).

    The engine's thread calls `store` (right after the step's demotion copies filled the host
    slots it names), `read`, `poll` and `drain`; `close` stops the threads after the queued writes.
    """

    def __init__(self, directory: str | os.PathLike, identity: bytes, host_caches: list[KVCache], max_bytes: int,
                 cuda: bool = False):
        self.identity = identity
        self.host_caches = host_caches
        self.dir = Path(directory) / identity.hex()[:32]
        self.block_bytes = sum(t[0].numel() * t.element_size() for layer in host_caches for t in layer)
        self.file_bytes = _HEADER.size + self.block_bytes
        self.max_blocks = max_bytes // self.file_bytes
        self.enabled = True
        self._cuda = cuda  # the host caches are pinned and copied to and from a CUDA device
        # Counters (cumulative), read by the engine's stats.
        self.num_written = self.num_write_errors = 0
        self.write_seconds = 0.0
        self.num_read = self.num_read_misses = self.num_corrupt = 0
        self.read_seconds = 0.0
        self._pending: dict[bytes, torch.Tensor] = {}  # queued writes: a read is served from them
        self._lock = threading.Lock()
        self._done: list[tuple[bytes, bool]] = []
        self._done_cond = threading.Condition(self._lock)
        self._num_reading = 0
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self.hashes_at_start: list[bytes] = []
        if self.max_blocks < 1:
            self._disable(f"disk_cache_gb is less than one block file ({self.file_bytes} bytes)")
        else:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self.hashes_at_start = self._scan()
                probe = self.dir / f".probe.{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                self._disable(f"{self.dir} is not usable: {e}")
        self._threads = [threading.Thread(target=self._write_loop, name="tokenmill-disk-writer", daemon=True),
                         threading.Thread(target=self._read_loop, name="tokenmill-disk-reader", daemon=True)]
        for t in self._threads:
            t.start()

    def _disable(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            logger.warning("prefix cache disk tier off, serving goes on without it: %s", why)

    def _scan(self) -> list[bytes]:
        """The block files already here, oldest first; leftovers of interrupted writes deleted."""
        found = []
        for path in self.dir.iterdir():
            if path.name.startswith(".tmp."):
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX and len(path.stem) == 64:
                try:
                    found.append((path.stat().st_mtime, bytes.fromhex(path.stem)))
                except (ValueError, OSError):
                    continue
        return [h for _, h in sorted(found)]

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    # -- on the engine's thread -------------------------------------------------------------

    def _sync(self) -> None:
        """On CUDA, wait for the stream's copies into and out of the pinned host slots."""
        if self._cuda:
            torch.cuda.current_stream().synchronize()

    def store(self, ops: list[tuple[bytes, int | None]]) -> None:
        """Queue, in order, a write of each host slot's block under its hash (slot None: delete
        the hash's file). The slots' bytes are taken now: the tier may reuse them next step."""
        if not ops or not self.enabled:
            return
        self._sync()
        for block_hash, slot in ops:
            data = None if slot is None else self._snapshot(slot)
            if data is not None:
                with self._lock:
                    self._pending[block_hash] = data
            self._writes.put((block_hash, data))

    def read(self, reads: list[tuple[bytes, int]]) -> None:
        """Read each hash's block into its host slot in the background; `poll` reports them."""
        if not reads:
            return
        self._sync()  # (a slot handed to a read may have been promoted from just before)
        with self._lock:
            self._num_reading += len(reads)
        for item in reads:
            self._reads.put(item)

    def poll(self, wait: bool = False) -> list[tuple[bytes, bool]]:
        """The reads that ended since the last call: (hash, whether the block is in its slot).
        With `wait`, first wait until every read asked for has ended."""
        with self._done_cond:
            if wait:
                self._done_cond.wait_for(lambda: self._num_reading == 0, timeout=30.0)
            done, self._done = self._done, []
        return done

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queued writes to reach their files; whether they did."""
        with self._done_cond:
            return self._done_cond.wait_for(lambda: not self._pending, timeout=max(timeout, 0.0))

    def close(self) -> None:
        """Finish the queued writes and reads, then stop the threads. Idempotent."""
        for q in (self._writes, self._reads):
            q.put(None)
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join()

    # -- block bytes --------------------------------------------------------------------------

    def _tensors(self, slot: int) -> list[torch.Tensor]:
        """The slot's bytes in each cache tensor, in file order."""
        return [indexable(t)[slot].reshape(-1).view(torch.uint8) for layer in self.host_caches for t in layer]

    def _snapshot(self, slot: int) -> torch.Tensor:
        return torch.cat(self._tensors(slot))

    def _fill(self, slot: int, payload: torch.Tensor) -> None:
        start = 0
        for dst in self._tensors(slot):
            dst.copy_(payload[start : start + dst.numel()])
            start += dst.numel()

    # -- background threads -------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            block_hash, data = item
            try:
                if data is None:
                    self.path(block_hash).unlink(missing_ok=True)
                elif self.enabled:
                    self._write(block_hash, data)
            except OSError as e:
                self.num_write_errors += 1
                self._disable(f"writing {self.path(block_hash)} failed: {e}")
            finally:
                if data is not None:
                    with self._done_cond:
                        if self._pending.get(block_hash) is data:
                            del self._pending[block_hash]
                        self._done_cond.notify_all()

    def _write(self, block_hash: bytes, data: torch.Tensor) -> None:
        start = time.perf_counter()
        payload = memoryview(data.numpy())
        header = _HEADER.pack(MAGIC, self.identity, block_hash, len(payload), zlib.crc32(payload))
        tmp = self.dir / f".tmp.{os.getpid()}.{threading.get_ident()}.{block_hash.hex()}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path(block_hash))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.write_seconds += time.perf_counter() - start
        self.num_written += 1

    def _read_loop(self) -> None:
        while (item := self._reads.get()) is not None:
            block_hash, slot = item
            try:
                ok = self._read(block_hash, slot)
            except Exception:  # noqa: BLE001 - a read that fails is a miss, never a dead engine
                logger.exception("reading the disk cache's block %s failed", block_hash.hex())
                ok = False
            with self._done_cond:
                self._done.append((block_hash, ok))
                self._num_reading -= 1
                self._done_cond.notify_all()

    def _read(self, block_hash: bytes, slot: int) -> bool:
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:  # not written yet: the bytes are still here
            self._fill(slot, pending)
            self.num_read += 1
            return True
        start = time.perf_counter()
        path = self.path(block_hash)
        try:
            raw = path.read_bytes()
        except OSError:
            self.num_read_misses += 1
            return False
        if not self._valid(raw, block_hash):
            self.num_corrupt += 1
            logger.warning("disk cache: %s is torn or corrupted; deleted, read as a miss", path)
            path.unlink(missing_ok=True)
            return False
        self._fill(slot, torch.frombuffer(bytearray(raw[_HEADER.size :]), dtype=torch.uint8))
        self.read_seconds += time.perf_counter() - start
        self.num_read += 1
        return True

    def _valid(self, raw: bytes, block_hash: bytes) -> bool:
        if len(raw) != self.file_bytes:
            return False
        magic, identity, stored_hash, length, crc = _HEADER.unpack_from(raw)
        payload = memoryview(raw)[_HEADER.size :]
        return (magic == MAGIC and identity == self.identity and stored_hash == block_hash
                and length == self.block_bytes and zlib.crc32(payload) == crc)
