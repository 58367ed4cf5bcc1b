"""The encode stage and the token cache: hits skip the tower, shared images encode once,
bad entries are dropped and re-encoded, never fed on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ingest.stage import store_image
from storage.object_store import LocalObjectStore
from storage.token_cache import FolderTokenCache
from worker.tokens.store import VisualTokenStore
from worker.tokens.tensors import VisualTokens


@pytest.fixture
def tokens(tmp_path, tiny_adapter) -> VisualTokenStore:
    store = LocalObjectStore(tmp_path / "store")
    cache = FolderTokenCache(tmp_path / "cache", max_bytes=1 << 30)
    return VisualTokenStore(tiny_adapter, cache, store, batch_images=4)


def _image_keys(tokens: VisualTokenStore, n: int) -> list[str]:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (112, 140 + 28 * i, 3), dtype=np.uint8)) for i in range(n)]
    return [store_image(tokens.store, img) for img in images]


def test_hits_skip_the_tower_and_shared_images_encode_once(tokens):
    keys = _image_keys(tokens, 3)
    units = [(1, keys[0]), (2, keys[1]), (3, keys[2]), (4, keys[0])]  # unit 4 repeats unit 1's page
    first = tokens.encode_units(units)
    assert [o.cache_hit for o in first] == [False, False, False, True]
    assert tokens.stats.images_encoded == 3
    again = tokens.encode_units(units)
    assert all(o.cache_hit and o.error is None for o in again)
    assert tokens.stats.images_encoded == 3  # the tower did not run again


@pytest.mark.parametrize("damage", ["truncate", "wrong_shape", "other_model", "nan"])
def test_bad_entry_is_dropped_and_reencoded(tokens, tiny_adapter, damage):
    [key] = _image_keys(tokens, 1)
    tokens.encode_units([(1, key)])
    cache_key = tokens.cache_key(key)
    good = tiny_adapter.decode_tokens(tokens.cache.get(cache_key))
    if damage == "truncate":
        bad = tokens.cache.get(cache_key)[:100]
    elif damage == "wrong_shape":
        bad = VisualTokens(good.embeds[:-1], good.grid_thw).to_bytes(tiny_adapter.fingerprint)
    elif damage == "other_model":
        bad = good.to_bytes("another-model-fingerprint")
    else:
        bad = VisualTokens(torch.full_like(good.embeds, float("nan")), good.grid_thw).to_bytes(
            tiny_adapter.fingerprint
        )
    tokens.cache.put(cache_key, bad)
    before = tokens.stats.images_encoded
    [outcome] = tokens.encode_units([(1, key)])
    assert outcome.error is None and not outcome.cache_hit
    assert tokens.stats.images_encoded == before + 1 and tokens.stats.corrupt_entries == 1
    assert torch.equal(tokens.get(key).embeds, good.embeds)


def test_missing_image_is_an_error_on_the_unit(tokens):
    [outcome] = tokens.encode_units([(7, "images/ab/" + "ab" * 32 + ".png")])
    assert outcome.error and "missing" in outcome.error


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl", "idefics3"]
)
def test_vision_only_encode_equals_the_full_model(family_model_dir, family):
    """Beside vLLM an encode worker loads the tower alone: same tokens (and deepstack), no LM weights."""
    from worker.models import ModelRef, load_adapter

    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 255, (120, 200, 3), dtype=np.uint8))]
    full = load_adapter(ModelRef(str(family_model_dir(family))))
    alone = load_adapter(ModelRef(str(family_model_dir(family))))
    alone.vision_only = True
    expected, got = full.encode(images)[0], alone.encode(images)[0]
    assert torch.equal(expected.embeds, got.embeds) and torch.equal(expected.grid_thw, got.grid_thw)
    assert expected.extras.keys() == got.extras.keys()
    assert all(torch.equal(expected.extras[k], got.extras[k]) for k in expected.extras)
    assert "model" not in alone.__dict__  # the language model was never loaded
