"""vLLM's own LLaVA-OneVision and InternVL models, taking cached visual tokens of any size in one
step: a vLLM plugin (issue 35).

vLLM 0.32 takes image embeddings for both families, but declares the embeddings of one encoder
batch as ONE (images, tokens, hidden) tensor: two pages of different token counts scheduled in
the same step raise "data contains inconsistent shapes" inside the engine core, which kills it
(and a `vllm serve` with it). Each class here is vLLM's own with that one declaration relaxed:
the token count may differ per image (``dynamic_dims``, as vLLM declares gemma3n's and
audioflamingo3's inputs), and the embeddings are handed on per image as they come. Everything
else, the pixel path included, is inherited.

vLLM calls ``register`` in each of its processes (the engine core too) through the
``vllm.general_plugins`` entry point in pyproject.toml, so a `vllm serve` started where visbatch
is installed takes them as the in-process engine does. A vLLM whose own class already takes
mixed sizes gets nothing registered (``_needs_plugin``): the plugin steps aside.

Imported only by vLLM (it imports vLLM): nothing else of visbatch loads it.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import torch
from vllm.model_executor.models.interns1 import (
    InternS1ForConditionalGeneration,
    InternS1ImageEmbeddingInputs,
)
from vllm.model_executor.models.llava_onevision import (
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageEmbeddingInputs,
)
from vllm.utils.tensor_schema import TensorShape

log = logging.getLogger(__name__)


class LlavaOnevisionAnySizeEmbeddings(LlavaOnevisionImageEmbeddingInputs):
    data: Annotated[torch.Tensor | list[torch.Tensor], TensorShape("bn", "ifs", "hs", dynamic_dims={"ifs"})]


class LlavaOnevisionAnySize(LlavaOnevisionForConditionalGeneration):
    def _parse_and_validate_image_input(self, **kwargs: object) -> Any:
        if kwargs.get("pixel_values") is None and kwargs.get("image_embeds") is not None:
            return LlavaOnevisionAnySizeEmbeddings(type="image_embeds", data=kwargs["image_embeds"])
        return super()._parse_and_validate_image_input(**kwargs)


class InternS1AnySizeEmbeddings(InternS1ImageEmbeddingInputs):
    data: Annotated[torch.Tensor | list[torch.Tensor], TensorShape("ni", "tifs", "hs", dynamic_dims={"tifs"})]


class InternVLAnySize(InternS1ForConditionalGeneration):
    """The class vLLM runs InternVL's `-hf` checkpoints with (InternS1)."""

    def _parse_and_validate_image_input(self, **kwargs: object) -> Any:
        if kwargs.get("pixel_values") is None and kwargs.get("image_embeds") is not None:
            return InternS1AnySizeEmbeddings(type="image_embeds", data=kwargs["image_embeds"])
        return super()._parse_and_validate_image_input(**kwargs)


# architecture (the checkpoint's config) -> (vLLM's embeddings input, the class that relaxes it)
PLUGINS: dict[str, tuple[type, type]] = {
    "LlavaOnevisionForConditionalGeneration": (LlavaOnevisionImageEmbeddingInputs, LlavaOnevisionAnySize),
    "InternVLForConditionalGeneration": (InternS1ImageEmbeddingInputs, InternVLAnySize),
}


def _needs_plugin(upstream_input: type) -> bool:
    """Whether vLLM's own embeddings input still refuses two images of different token counts."""
    try:
        upstream_input(type="image_embeds", data=[torch.zeros(2, 4), torch.zeros(3, 4)])
    except ValueError:
        return True
    return False


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: our classes for the architectures that need them."""
    from vllm import ModelRegistry

    for architecture, (upstream_input, model_class) in PLUGINS.items():
        if _needs_plugin(upstream_input):
            ModelRegistry.register_model(architecture, model_class)
        else:
            log.info("visbatch: vLLM's own %s takes mixed image sizes; its plugin steps aside", architecture)
