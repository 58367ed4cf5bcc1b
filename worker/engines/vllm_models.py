"""vLLM's own LLaVA-OneVision, InternVL and Idefics3 models, taking cached visual tokens of any
size in one step: a vLLM plugin (issue 35).

vLLM 0.32 takes image embeddings for LLaVA-OneVision and InternVL, but declares the embeddings of
one encoder batch as ONE (images, tokens, hidden) tensor: two pages of different token counts
scheduled in the same step raise "data contains inconsistent shapes" inside the engine core,
which kills it (and a `vllm serve` with it). Each class here is vLLM's own with that one
declaration relaxed: the token count may differ per image (``dynamic_dims``, as vLLM declares
gemma3n's and audioflamingo3's inputs), and the embeddings are handed on per image as they come.
Everything else, the pixel path included, is inherited.

Idefics3 (granite-docling, SmolDocling) needs one thing more: vLLM's processor writes each
image's prompt (a ``<row_i_col_j>`` tag per tile, the global view) from the image's size, and so
refuses embeddings. Here an image may come as its embeddings and its tile grid (``image_embeds``
+ ``image_grid``, (1, rows, cols), as visbatch caches it), the way vLLM's Qwen2-VL takes an
image's embeddings with its ``image_grid_thw``; the prompt is then written from the grid by
vLLM's own ``get_image_repl`` (the grid handed to it in place of the size's).

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
from vllm.model_executor.models.idefics3 import (
    Idefics3DummyInputsBuilder,
    Idefics3ForConditionalGeneration,
    Idefics3ImageEmbeddingInputs,
    Idefics3MultiModalProcessor,
    Idefics3ProcessingInfo,
)
from vllm.model_executor.models.interns1 import (
    InternS1ForConditionalGeneration,
    InternS1ImageEmbeddingInputs,
)
from vllm.model_executor.models.llava_onevision import (
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageEmbeddingInputs,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import DictEmbeddingItems, MultiModalDataParser
from vllm.multimodal.processing import (
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdateDetails,
    cached_encode,
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


# The tile grid an Idefics3 image's embeddings come with, (1, rows, cols) per image: the layout
# visbatch caches (worker/models/idefics3.py; (1, 0, 0): one tile, no global view).
IDEFICS3_GRID = "image_grid"
# mm_kwargs key carrying a cached grid to Idefics3GridInfo._get_image_feature_grid_size.
_CACHED_GRID = "visbatch_cached_grid"


def _idefics3_tokens(grid: torch.Tensor, image_seq_len: int) -> torch.Tensor:
    """Visual tokens per image of (images, 3) grids: a tile each and the global view, or one tile."""
    grid = torch.as_tensor(grid).reshape(-1, 3)
    tiles = grid[:, 1] * grid[:, 2]
    return torch.where(tiles > 0, tiles + 1, 1) * image_seq_len


def _idefics3_fields(image_seq_len: int) -> Any:
    def fields(hf_inputs: Any) -> dict[str, MultiModalFieldConfig]:
        grid = hf_inputs.get(IDEFICS3_GRID, torch.empty((0, 3), dtype=torch.int64))
        return {
            "image_embeds": MultiModalFieldConfig.flat_from_sizes(
                "image", _idefics3_tokens(grid, image_seq_len)
            ),
            IDEFICS3_GRID: MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    return fields


class Idefics3GridParser(MultiModalDataParser):
    """An image may be its embeddings and its tile grid (a dict), as Qwen2-VL's parser takes them."""

    embedding_fields = {"image": {"image_embeds": "values", IDEFICS3_GRID: "metadata"}}

    def __init__(self, image_seq_len: int, *args: Any, **kwargs: Any) -> None:
        self._image_seq_len = image_seq_len
        super().__init__(*args, **kwargs)

    def _parse_image_data(self, data: Any) -> Any:
        if isinstance(data, dict):
            required, optional = self.embedding_field_sets("image")
            return DictEmbeddingItems(
                data,
                modality="image",
                required_fields=required,
                optional_fields=optional,
                fields_factory=_idefics3_fields(self._image_seq_len),
            )
        return super()._parse_image_data(data)


class Idefics3GridInfo(Idefics3ProcessingInfo):
    def get_data_parser(self) -> MultiModalDataParser:
        return Idefics3GridParser(
            self.get_hf_processor().image_seq_len,
            expected_hidden_size=self._get_expected_hidden_size(),
            allow_missing_mm_embeddings=self.allow_missing_mm_embeddings,
        )

    def _get_image_feature_grid_size(self, **kwargs: Any) -> tuple[int, int, int]:
        grid = kwargs["mm_kwargs"].get(_CACHED_GRID)
        if grid is None:
            return super()._get_image_feature_grid_size(**kwargs)
        rows, cols = grid
        return (rows * cols + 1 if rows * cols else 0), rows, cols


class Idefics3GridProcessor(Idefics3MultiModalProcessor):
    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Any) -> Any:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        image_seq_len = self.info.get_hf_processor(**hf_processor_mm_kwargs).image_seq_len
        return {**fields, **_idefics3_fields(image_seq_len)(hf_inputs)}

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Any:
        if not isinstance(mm_items.get("image"), DictEmbeddingItems):
            return super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        hf_processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        tokenizer = self.info.get_tokenizer()

        def replacement(item_idx: int) -> PromptUpdateDetails:
            _, rows, cols = (int(x) for x in out_mm_kwargs["image"][item_idx][IDEFICS3_GRID].data.view(-1))
            text = self.info.get_image_repl(
                image_width=0,
                image_height=0,
                processor=hf_processor,
                mm_kwargs={**hf_processor_mm_kwargs, _CACHED_GRID: (rows, cols)},
            )
            ids = cached_encode(tokenizer, text, add_special_tokens=False)
            return PromptUpdateDetails.select_token_id(ids, hf_processor.image_token_id)

        return [
            PromptReplacement(modality="image", target=[hf_processor.image_token_id], replacement=replacement)
        ]


class Idefics3AnySizeEmbeddings(Idefics3ImageEmbeddingInputs):
    data: Annotated[torch.Tensor | list[torch.Tensor], TensorShape("bn", "f", "h", dynamic_dims={"f"})]


@MULTIMODAL_REGISTRY.register_processor(
    Idefics3GridProcessor, info=Idefics3GridInfo, dummy_inputs=Idefics3DummyInputsBuilder
)
class Idefics3AnySize(Idefics3ForConditionalGeneration):
    def _parse_and_validate_image_input(self, **kwargs: object) -> Any:
        grid = kwargs.get(IDEFICS3_GRID)
        if kwargs.get("pixel_values") is None and kwargs.get("image_embeds") is not None and grid is not None:
            # The images' embeddings end to end (a flat field): each its grid's share.
            sizes = _idefics3_tokens(grid, self.model.image_seq_len).tolist()
            data = torch.split(torch.as_tensor(kwargs["image_embeds"]).flatten(0, -2), sizes)
            return Idefics3AnySizeEmbeddings(type="image_embeds", data=list(data))
        return super()._parse_and_validate_image_input(**kwargs)


# architecture (the checkpoint's config) -> (vLLM's embeddings input, the class that relaxes it)
PLUGINS: dict[str, tuple[type, type]] = {
    "LlavaOnevisionForConditionalGeneration": (LlavaOnevisionImageEmbeddingInputs, LlavaOnevisionAnySize),
    "InternVLForConditionalGeneration": (InternS1ImageEmbeddingInputs, InternVLAnySize),
    "Idefics3ForConditionalGeneration": (Idefics3ImageEmbeddingInputs, Idefics3AnySize),
}


def _needs_plugin(architecture: str, upstream_input: type) -> bool:
    """Whether vLLM's own class still refuses two images of different token counts (or, for
    Idefics3, embeddings at all: its processing info has no parser of its own for them)."""
    if architecture == "Idefics3ForConditionalGeneration" and (
        Idefics3ProcessingInfo.get_data_parser is BaseProcessingInfo.get_data_parser
    ):
        return True
    try:
        upstream_input(type="image_embeds", data=[torch.zeros(2, 4), torch.zeros(3, 4)])
    except ValueError:
        return True
    return False


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: our classes for the architectures that need them."""
    from vllm import ModelRegistry

    for architecture, (upstream_input, model_class) in PLUGINS.items():
        if _needs_plugin(architecture, upstream_input):
            ModelRegistry.register_model(architecture, model_class)
        else:
            log.info("visbatch: vLLM's own %s takes mixed image sizes; its plugin steps aside", architecture)
