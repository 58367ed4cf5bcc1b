"""Model families visbatch supports, chosen by the `model_type` in the model's config."""

from __future__ import annotations

import json
from pathlib import Path

from worker.models.base import ModelAdapter, ModelRef
from worker.models.qwen2_vl import Qwen2VLAdapter, Qwen25VLAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    "qwen2_vl": Qwen2VLAdapter,
    "qwen2_5_vl": Qwen25VLAdapter,
}


class UnsupportedModel(ValueError):
    pass


def _model_type(ref: ModelRef) -> str:
    local = Path(ref.source) / "config.json"
    if local.is_file():
        return json.loads(local.read_text()).get("model_type", "")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ref.source, revision=ref.revision).model_type


def load_adapter(ref: ModelRef) -> ModelAdapter:
    model_type = _model_type(ref)
    try:
        cls = ADAPTERS[model_type]
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported (supported: {supported})"
        ) from None
    return cls(ref)


__all__ = ["ADAPTERS", "ModelAdapter", "ModelRef", "UnsupportedModel", "load_adapter"]
