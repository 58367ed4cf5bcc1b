"""Compressed token-cache entries (VISBATCH_CACHE_COMPRESSION=zstd): lossless, smaller, read beside
uncompressed ones whichever way the setting is, and a damaged or oversized frame is a bad entry
(dropped and re-encoded), never fed to an engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ingest.pdf import render_pdf_pages
from ingest.stage import store_image
from storage.object_store import LocalObjectStore
from storage.token_cache import FolderTokenCache
from tests.media import write_pdf
from visbatch.settings import SettingError
from worker.tokens.store import VisualTokenStore
from worker.tokens.tensors import COMPRESSED_MAGIC, InvalidVisualTokens, VisualTokens


def _page_keys(store: LocalObjectStore, tmp_path: Path, pages: int = 2) -> list[str]:
    pdf = write_pdf(tmp_path / "doc.pdf", pages=pages)
    images = [getattr(item, "image", item) for item in render_pdf_pages(pdf)]
    return [store_image(store, img[1] if isinstance(img, tuple) else img) for img in images]


def _stores(tmp_path: Path, adapter) -> tuple[VisualTokenStore, VisualTokenStore]:
    """Two stores over one folder cache: one writes compressed entries, one plain ones."""
    store = LocalObjectStore(tmp_path / "store")
    cache = FolderTokenCache(tmp_path / "cache", max_bytes=1 << 30)
    return (VisualTokenStore(adapter, cache, store, compress=True), VisualTokenStore(adapter, cache, store))


def _same(a: VisualTokens, b: VisualTokens) -> bool:
    return torch.equal(a.embeds, b.embeds) and torch.equal(a.grid_thw, b.grid_thw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_lossless_and_smaller(tiny_adapter, tmp_path, dtype) -> None:
    zstd, _ = _stores(tmp_path, tiny_adapter)
    [key] = _page_keys(zstd.store, tmp_path, pages=1)
    [tokens] = zstd.encode_keys([key])
    tokens = VisualTokens(tokens.embeds.to(dtype), tokens.grid_thw)  # bf16: what a GPU writes
    plain = tokens.to_bytes("fp")
    packed = tokens.to_bytes("fp", compress=True)
    assert packed.startswith(COMPRESSED_MAGIC) and not plain.startswith(COMPRESSED_MAGIC)
    assert len(packed) < len(plain)
    spec = tiny_adapter.token_spec
    spec = type(spec)(spec.hidden_size, dtype, spec.tokens_for_grid, spec.extras)
    back = VisualTokens.from_bytes(packed, fingerprint="fp", spec=spec)
    assert _same(back, tokens) and back.embeds.dtype == dtype


def test_both_kinds_read_whichever_way_the_setting_is(tiny_adapter, tmp_path) -> None:
    zstd, plain = _stores(tmp_path, tiny_adapter)
    keys = _page_keys(zstd.store, tmp_path)
    zstd.encode_units([(1, keys[0])])  # written compressed
    plain.encode_units([(2, keys[1])])  # written plain (an entry from before the setting)
    raw = [zstd.cache.get(zstd.cache_key(k)) for k in keys]
    assert raw[0].startswith(COMPRESSED_MAGIC) and not raw[1].startswith(COMPRESSED_MAGIC)
    for reader in (zstd, plain):
        outcomes = reader.encode_units([(1, keys[0]), (2, keys[1])])
        assert all(o.cache_hit for o in outcomes)
        assert _same(reader.get(keys[0]), plain.get(keys[0]))
    assert zstd.stats.images_encoded == 1 and plain.stats.images_encoded == 1  # no re-encoding


@pytest.mark.parametrize("damage", ["truncated", "bomb", "garbage"])
def test_damaged_frame_is_dropped_and_reencoded(tiny_adapter, tmp_path, damage) -> None:
    import zstandard

    zstd, _ = _stores(tmp_path, tiny_adapter)
    [key] = _page_keys(zstd.store, tmp_path, pages=1)
    zstd.encode_units([(1, key)])
    cache_key = zstd.cache_key(key)
    good = zstd.cache.get(cache_key)
    bad = {
        "truncated": good[: len(good) // 2],
        # A frame that claims 8 GiB: refused before anything is allocated.
        "bomb": COMPRESSED_MAGIC + zstandard.ZstdCompressor().compress(b"\0" * 1024)[:4]
        + bytes([0x60 | 0x00]) + (8 * 1024**3).to_bytes(8, "little") + b"\0" * 16,
        "garbage": COMPRESSED_MAGIC + b"not a zstd frame at all",
    }[damage]  # fmt: skip
    with pytest.raises(InvalidVisualTokens):
        tiny_adapter.decode_tokens(bad)
    zstd.cache.put(cache_key, bad)
    [outcome] = zstd.encode_units([(1, key)])
    assert not outcome.cache_hit and zstd.stats.corrupt_entries == 1  # dropped, encoded again
    assert zstd.cache.get(cache_key).startswith(COMPRESSED_MAGIC)


def test_unknown_compression_setting_is_refused(settings_factory) -> None:
    from worker.runtime import Runtime

    rt = Runtime(settings_factory(cache_compression="lzma"))
    with pytest.raises(SettingError, match="VISBATCH_CACHE_COMPRESSION='lzma'"):
        _ = rt.token_store
