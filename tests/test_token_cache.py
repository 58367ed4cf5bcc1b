from __future__ import annotations

import os
import time

import pytest
import torch

from storage.keys import UnsafeKey, check_key
from storage.object_store import LocalObjectStore, ObjectNotFound
from storage.token_cache import FolderTokenCache
from worker.visual_tokens import InvalidVisualTokens, VisualTokens


def _key(n: int) -> str:
    return f"{n:064x}"


def test_lru_eviction_by_bytes(tmp_path):
    cache = FolderTokenCache(tmp_path, max_bytes=10_000)
    for n in range(5):
        cache.put(_key(n), b"x" * 3000)
        time.sleep(0.01)
        if n == 2:
            assert cache.get(_key(0)) is not None  # touch: 0 becomes most recent
    assert cache.size_bytes <= 10_000
    assert cache.get(_key(0)) is not None
    assert cache.get(_key(1)) is None  # the least recently used went first
    assert cache.stats.evictions >= 2


def test_hits_misses_bytes(tmp_path):
    cache = FolderTokenCache(tmp_path, max_bytes=1 << 20)
    assert cache.get(_key(1)) is None
    cache.put(_key(1), b"abc")
    assert cache.get(_key(1)) == b"abc"
    assert (cache.stats.hits, cache.stats.misses, cache.stats.bytes_read, cache.stats.bytes_written) == (
        1,
        1,
        3,
        3,
    )


def test_size_survives_restart(tmp_path):
    FolderTokenCache(tmp_path, max_bytes=1 << 20).put(_key(2), b"y" * 100)
    assert FolderTokenCache(tmp_path, max_bytes=1 << 20).size_bytes == 100


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "a/../b", "a\nb", "", "images/\x00", "a//b"])
def test_unsafe_keys_rejected(tmp_path, key):
    with pytest.raises(UnsafeKey):
        check_key(key)
    with pytest.raises(UnsafeKey):
        LocalObjectStore(tmp_path).put_bytes(key, b"x")


def test_object_store_roundtrip(tmp_path):
    store = LocalObjectStore(tmp_path)
    store.put_bytes("images/ab/abc.png", b"png")
    assert store.get_bytes("images/ab/abc.png") == b"png"
    assert not [p for p in os.listdir(tmp_path / "images" / "ab") if p.startswith(".tmp")]
    with pytest.raises(ObjectNotFound):
        store.get_bytes("images/ab/none.png")


def _tokens(n: int = 4, hidden: int = 8) -> VisualTokens:
    return VisualTokens(embeds=torch.randn(n, hidden), grid_thw=torch.tensor([[1, 2, 2 * n]]))


def _load(data: bytes, **overrides):
    args = {"fingerprint": "fp", "hidden_size": 8, "merge_size": 2, "dtype": torch.float32, **overrides}
    return VisualTokens.from_bytes(data, **args)


def test_visual_tokens_roundtrip():
    vt = _tokens()
    back = _load(vt.to_bytes("fp"))
    assert torch.equal(back.embeds, vt.embeds) and torch.equal(back.grid_thw, vt.grid_thw)


@pytest.mark.parametrize(
    "overrides",
    [{"fingerprint": "other"}, {"hidden_size": 16}, {"merge_size": 1}, {"dtype": torch.bfloat16}],
)
def test_visual_tokens_mismatch_rejected(overrides):
    with pytest.raises(InvalidVisualTokens):
        _load(_tokens().to_bytes("fp"), **overrides)


def test_corrupt_bytes_rejected():
    data = bytearray(_tokens().to_bytes("fp"))
    with pytest.raises(InvalidVisualTokens):
        _load(bytes(data[: len(data) // 2]))
    bad = VisualTokens(embeds=torch.full((4, 8), float("nan")), grid_thw=torch.tensor([[1, 2, 8]]))
    with pytest.raises(InvalidVisualTokens):
        _load(bad.to_bytes("fp"))
