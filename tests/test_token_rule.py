"""The ingest-time visual-token count equals what the processor actually produces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    width=st.integers(min_value=10, max_value=2400),
    height=st.integers(min_value=10, max_value=2400),
)
def test_token_count_matches_processor(tiny_adapter, width, height):
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(ValueError):
            tiny_adapter.visual_tokens(width, height)
        return
    image = Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))
    grid = tiny_adapter.processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    assert tiny_adapter.visual_tokens(width, height) == int(grid.prod()) // tiny_adapter.merge_size**2


def test_known_counts(tiny_adapter):
    # Figures from the Qwen2-VL documentation: 448x448 -> 256 tokens, 1280x720 -> 1196.
    assert tiny_adapter.visual_tokens(448, 448) == 256
    assert tiny_adapter.visual_tokens(1280, 720) == 1196


def test_an_unreachable_hub_is_said_so_not_taken_for_a_missing_file(monkeypatch):
    """huggingface_hub 1.x raises LocalEntryNotFoundError (a subclass of EntryNotFoundError) when
    the hub cannot be reached: that is not "the model has no such file". The hub is mocked."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    from ingest.token_rules import ModelFilesUnavailable, model_file

    calls = []

    def offline(repo, name, revision=None, local_files_only=False, **kwargs):
        calls.append(local_files_only)
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(ModelFilesUnavailable, match="is the model hub reachable"):
        model_file("Org/model", "config.json")
    assert calls == [True, False]  # the cache, then the hub

    def missing(repo, name, revision=None, local_files_only=False, **kwargs):
        raise EntryNotFoundError("404")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    assert model_file("Org/model", "processor_config.json") is None
