"""Shared fixtures: the tiny random models (built offline once per session) and a runtime on them.

The model hub cannot be reached here, so every model test uses this random model: it runs the
real transformers classes, processor and vision tower; only the weights are fake.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from visbatch.settings import Settings


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from worker.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_adapter(tiny_model_dir):
    from worker.models import ModelRef, load_adapter

    return load_adapter(ModelRef(str(tiny_model_dir)))


# Every supported family (worker.models.ADAPTERS), as the tiny model builder spells them.
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "idefics3", "internvl"]
FAMILIES += ["llava_onevision"]


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory):
    """family -> folder of its tiny model, each built once per session on first use."""
    from worker.models.tiny import write_tiny_model

    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            folders[family] = write_tiny_model(tmp_path_factory.mktemp(family), family=family)
        return folders[family]

    return get


@pytest.fixture(scope="session", params=FAMILIES)
def family_adapter(request, family_model_dir):
    """A tiny adapter per supported family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Idefics3)."""
    from worker.models import ModelRef, load_adapter

    adapter = load_adapter(ModelRef(str(family_model_dir(request.param))))
    assert adapter.family == request.param
    return adapter


@pytest.fixture
def settings_factory(tmp_path, tiny_model_dir):
    def make(**overrides) -> Settings:
        values = {"home": tmp_path / "home", "model": str(tiny_model_dir), **overrides}
        return Settings(**values)

    return make
