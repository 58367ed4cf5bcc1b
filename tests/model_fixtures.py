"""Shared fixtures: the tiny random Qwen2-VL (built offline once per session) and a runtime on it.

The model hub cannot be reached here, so every model test uses this random model: it runs the
real transformers classes, processor and vision tower; only the weights are fake.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.settings import Settings


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from worker.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_adapter(tiny_model_dir):
    from worker.models import ModelRef, load_adapter

    return load_adapter(ModelRef(str(tiny_model_dir)))


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def family_adapter(request, tmp_path_factory):
    """A tiny adapter per supported family (Qwen2-VL, Qwen2.5-VL)."""
    from worker.models import ModelRef, load_adapter
    from worker.models.tiny import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)
    adapter = load_adapter(ModelRef(str(folder)))
    assert adapter.family == request.param
    return adapter


@pytest.fixture
def settings_factory(tmp_path, tiny_model_dir):
    def make(**overrides) -> Settings:
        values = {"home": tmp_path / "home", "model": str(tiny_model_dir), **overrides}
        return Settings(**values)

    return make
