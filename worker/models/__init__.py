"""Model families visbatch supports, chosen by the `model_type` in the model's config.

The adapters import torch and transformers, so they are imported only when a model is loaded;
the token rule (what ingest and the planner need) lives in ingest.token_rules, without either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ingest.token_rules import UnsupportedModel, read_json_file

if TYPE_CHECKING:
    from worker.models.base import ModelAdapter, ModelRef

# model_type -> "module:class", imported on first use.
ADAPTERS: dict[str, str] = {
    "qwen2_vl": "worker.models.qwen2_vl:Qwen2VLAdapter",
    "qwen2_5_vl": "worker.models.qwen2_vl:Qwen25VLAdapter",
    "qwen3_vl": "worker.models.qwen3_vl:Qwen3VLAdapter",
    "qwen3_vl_moe": "worker.models.qwen3_vl:Qwen3VLMoeAdapter",
    "idefics3": "worker.models.idefics3:Idefics3Adapter",
    "internvl": "worker.models.internvl:InternVLAdapter",
    "llava_onevision": "worker.models.llava_onevision:LlavaOnevisionAdapter",
}


def model_type(source: str, revision: str | None = None) -> str:
    config = read_json_file(source, "config.json", revision) or {}
    return str(config.get("model_type", ""))


def adapter_class(family: str) -> type[ModelAdapter]:
    try:
        module, name = ADAPTERS[family].split(":")
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedModel(f"model type {family!r} is not supported (supported: {supported})") from None
    return getattr(importlib.import_module(module), name)


def load_adapter(ref: ModelRef) -> ModelAdapter:
    return adapter_class(model_type(ref.source, ref.revision))(ref)


def __getattr__(name: str):
    # ModelRef and ModelAdapter live beside torch; importing this package must not load it.
    if name in ("ModelRef", "ModelAdapter"):
        from worker.models import base

        return getattr(base, name)
    raise AttributeError(name)


__all__ = ["ADAPTERS", "ModelAdapter", "ModelRef", "UnsupportedModel", "adapter_class", "load_adapter"]
