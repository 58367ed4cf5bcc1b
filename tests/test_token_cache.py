from __future__ import annotations

import os
import time

import pytest
import torch

from storage.keys import UnsafeKey, check_key
from storage.object_store import LocalObjectStore, ObjectNotFound
from storage.token_cache import FolderTokenCache
from worker.tokens.tensors import InvalidVisualTokens, TokenSpec, VisualTokens


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


def _grid_tokens(merge: int):
    return lambda grid: int(grid.prod()) // merge**2


def _load(data: bytes, fingerprint: str = "fp", **overrides):
    spec = {"hidden_size": 8, "dtype": torch.float32, "tokens_for_grid": _grid_tokens(2), **overrides}
    return VisualTokens.from_bytes(data, fingerprint=fingerprint, spec=TokenSpec(**spec))


def test_visual_tokens_roundtrip():
    vt = _tokens()
    back = _load(vt.to_bytes("fp"))
    assert torch.equal(back.embeds, vt.embeds) and torch.equal(back.grid_thw, vt.grid_thw)


@pytest.mark.parametrize(
    "overrides",
    [
        {"fingerprint": "other"},
        {"hidden_size": 16},
        {"tokens_for_grid": _grid_tokens(1)},
        {"dtype": torch.bfloat16},
        {"extras": {"deepstack": (2, 8)}},  # the model needs an extra the entry lacks
    ],
)
def test_visual_tokens_mismatch_rejected(overrides):
    with pytest.raises(InvalidVisualTokens):
        _load(_tokens().to_bytes("fp"), **overrides)


def _with_deepstack(n: int = 4, layers: int = 2) -> VisualTokens:
    return VisualTokens(
        embeds=torch.randn(n, 8),
        grid_thw=torch.tensor([[1, 2, 2 * n]]),
        extras={"deepstack": torch.randn(layers, n, 8)},
    )


def test_extras_roundtrip_in_the_same_entry():
    vt = _with_deepstack()
    back = _load(vt.to_bytes("fp"), extras={"deepstack": (2, 8)})
    assert torch.equal(back.extras["deepstack"], vt.extras["deepstack"])
    assert torch.equal(back.embeds, vt.embeds)


@pytest.mark.parametrize(
    ("tokens", "needs"),
    [
        (_with_deepstack(layers=3), {"deepstack": (2, 8)}),  # another number of layers
        (_with_deepstack(), {"deepstack": (2, 16)}),  # another width
        (_with_deepstack(), {}),  # an extra the model does not take
        (_with_deepstack(), {"deepstack": (2, 8), "other": (1, 8)}),  # one it takes is missing
        (
            VisualTokens(torch.randn(4, 8), torch.tensor([[1, 2, 8]]), {"deepstack": torch.randn(2, 3, 8)}),
            {"deepstack": (2, 8)},  # fewer tokens than the embeddings
        ),
        (
            VisualTokens(
                torch.randn(4, 8),
                torch.tensor([[1, 2, 8]]),
                {"deepstack": torch.full((2, 4, 8), float("inf"))},
            ),
            {"deepstack": (2, 8)},
        ),
        (
            VisualTokens(
                torch.randn(4, 8), torch.tensor([[1, 2, 8]]), {"deepstack": torch.randn(2, 4, 8).half()}
            ),
            {"deepstack": (2, 8)},
        ),
    ],
)
def test_bad_extras_rejected(tokens, needs):
    with pytest.raises(InvalidVisualTokens):
        _load(tokens.to_bytes("fp"), extras=needs)


def test_format_1_entries_still_read_and_unknown_formats_do_not():
    import json

    from safetensors.torch import save as save_safetensors

    vt = _tokens()
    tensors = {"embeds": vt.embeds, "grid_thw": vt.grid_thw}

    def entry(meta: dict) -> bytes:
        return save_safetensors(tensors, metadata={"visbatch": json.dumps(meta)})

    old = entry({"format": "1", "fingerprint": "fp"})  # written before extras existed
    assert torch.equal(_load(old).embeds, vt.embeds)
    with pytest.raises(InvalidVisualTokens, match="extras"):  # a model that needs extras: a miss
        _load(old, extras={"deepstack": (2, 8)})
    with pytest.raises(InvalidVisualTokens, match="format"):
        _load(entry({"format": "3", "fingerprint": "fp"}))
    stray = save_safetensors(
        {**tensors, "pickle": torch.zeros(1)},
        metadata={"visbatch": json.dumps({"format": "2", "fingerprint": "fp"})},
    )
    with pytest.raises(InvalidVisualTokens, match="unknown tensors"):
        _load(stray)


def test_corrupt_bytes_rejected():
    data = bytearray(_tokens().to_bytes("fp"))
    with pytest.raises(InvalidVisualTokens):
        _load(bytes(data[: len(data) // 2]))
    bad = VisualTokens(embeds=torch.full((4, 8), float("nan")), grid_thw=torch.tensor([[1, 2, 8]]))
    with pytest.raises(InvalidVisualTokens):
        _load(bad.to_bytes("fp"))
