"""The disk tier's block files: round trip, crash safety, corruption, identity, a disk that fails."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenmill.worker.disk_store import DiskBlockStore, cache_identity

IDENTITY = cache_identity({"model": "m", "dtype": "float32"})
H0, H1 = bytes(range(32)), bytes(range(1, 33))


def host_caches(num_slots: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """Two layers of (key, value) host slots, and a float32 scale tensor as a quantized cache has."""
    return [(torch.zeros(num_slots, 2, 1, 3), torch.zeros(num_slots, 2, 1, 3), torch.zeros(num_slots, 2, 1))
            for _ in range(2)]


def fill(caches, slot: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for layer in caches:
        for t in layer:
            t[slot] = torch.randn(t[slot].shape, generator=g)
    return [t[slot].clone() for layer in caches for t in layer]


def read_back(store: DiskBlockStore, block_hash: bytes, slot: int) -> bool:
    store.read([(block_hash, slot)])
    ((got_hash, ok),) = store.poll(wait=True)
    assert got_hash == block_hash
    return ok


@pytest.fixture
def store(tmp_path):
    s = DiskBlockStore(tmp_path, IDENTITY, host_caches(), max_bytes=1 << 20)
    yield s
    s.close()


def written(store: DiskBlockStore, block_hash: bytes, slot: int, seed: int = 0) -> list[torch.Tensor]:
    contents = fill(store.host_caches, slot, seed)
    store.store([(block_hash, slot)])
    store.close()  # (the queued write is done once the writer stopped)
    return contents


def reopen(store: DiskBlockStore) -> DiskBlockStore:
    return DiskBlockStore(store.dir.parent, IDENTITY, host_caches(), max_bytes=1 << 20)


def test_a_block_survives_a_new_store_and_lands_in_another_slot(store):
    contents = written(store, H0, slot=1)
    again = reopen(store)
    try:
        assert again.hashes_at_start == [H0]
        assert read_back(again, H0, 3)
        assert all(torch.equal(t[3], c) for t, c in zip((t for layer in again.host_caches for t in layer), contents))
        assert again.num_read == 1 and again.num_corrupt == 0
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "identity"])
def test_a_torn_or_corrupted_file_is_a_counted_miss_and_deleted(store, damage):
    written(store, H0, slot=0)
    path = store.path(H0)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:  # a whole file of another identity, put where this one looks
        raw[8:40] = cache_identity({"model": "other"})
    path.write_bytes(bytes(raw))
    again = reopen(store)
    try:
        assert not read_back(again, H0, 2)
        assert again.num_corrupt == 1 and not path.exists()
        assert not read_back(again, H0, 2) and again.num_read_misses == 1  # gone: a plain miss now
    finally:
        again.close()


def test_another_identity_looks_in_another_folder(store):
    written(store, H0, slot=0)
    other = DiskBlockStore(store.dir.parent, cache_identity({"model": "m", "dtype": "bfloat16"}), host_caches(), 1 << 20)
    try:
        assert other.dir != store.dir and other.hashes_at_start == []
        assert not read_back(other, H0, 0)
    finally:
        other.close()


def test_a_queued_write_is_read_from_memory_and_deletes_follow_writes(tmp_path):
    s = DiskBlockStore(tmp_path, IDENTITY, host_caches(), max_bytes=1 << 20)
    try:
        contents = fill(s.host_caches, 0, seed=1)
        s.store([(H0, 0), (H1, 0), (H1, None)])
        assert read_back(s, H0, 2)
        assert all(torch.equal(t[2], c) for t, c in zip((t for layer in s.host_caches for t in layer), contents))
    finally:
        s.close()
    assert s.path(H0).exists() and not s.path(H1).exists()
    assert not list(s.dir.glob(".tmp.*"))


def test_an_unusable_directory_turns_the_tier_off(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    s = DiskBlockStore(not_a_dir, IDENTITY, host_caches(), max_bytes=1 << 20)
    s.close()
    assert not s.enabled and "disk tier off" in caplog.text


def test_a_failing_write_warns_once_and_turns_the_tier_off(store, caplog):
    fill(store.host_caches, 0, seed=2)
    store.dir.rmdir()
    store.dir.write_text("")  # the folder is gone: every write fails (as on a full disk)
    store.store([(H0, 0), (H1, 0)])
    store.close()
    assert not store.enabled and store.num_write_errors == 1
    assert caplog.text.count("disk tier off") == 1


def test_a_bound_below_one_file_turns_the_tier_off(tmp_path):
    s = DiskBlockStore(tmp_path, IDENTITY, host_caches(), max_bytes=100)
    s.close()
    assert not s.enabled and s.max_blocks == 0


def test_close_stops_the_threads(tmp_path):
    before = set(threading.enumerate())
    s = DiskBlockStore(tmp_path, IDENTITY, host_caches(), max_bytes=1 << 20)
    s.close()
    s.close()
    assert set(threading.enumerate()) == before
