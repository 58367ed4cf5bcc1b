"""Qwen2-VL and Qwen2.5-VL: 14-px patches merged 2x2, one visual token per 28x28 px after smart_resize.

The layout of an image's tokens is its patch grid `grid_thw` (t, h, w before the 2x2 merge);
the language model places them with M-RoPE, computed by the model's own `get_rope_index`.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from PIL import Image

from ingest.budget import PixelBounds
from worker.models.base import ModelAdapter
from worker.models.vision_tower import load_vision_tower
from worker.tokens.tensors import VisualTokens

# image == 1, video == 2 in the M-RoPE index (transformers' get_rope_index).
IMAGE_TOKEN_TYPE = 1


class Qwen2VLAdapter(ModelAdapter):
    family = "qwen2_vl"
    model_class_name = "Qwen2VLForConditionalGeneration"
    vllm_unsupported = None
    column_inputs = ("mm_token_type_ids",)

    # --- token rule: ingest.token_rules (ModelAdapter.count_visual_tokens) -----------------------

    def preprocessing(self, bounds: PixelBounds | None = None) -> dict[str, Any]:
        config = self.processor.image_processor.to_dict()
        bounds = self.token_geometry.normalize(bounds)
        if bounds is not None:  # a job's budget: the same call-time size the encode passes
            config["size"] = bounds.as_size()
        return config

    def _size_kwargs(self, bounds: PixelBounds | None) -> dict[str, Any]:
        bounds = self.token_geometry.normalize(bounds)
        return {} if bounds is None else {"size": bounds.as_size()}

    # --- weights -----------------------------------------------------------------------

    @property
    def merge_size(self) -> int:
        return int(self.processor.image_processor.merge_size)

    def tokens_for_grid(self, grid: torch.Tensor) -> int:
        """t*h*w / merge^2 for a grid of whole merges; ValueError for any other grid."""
        t, h, w = (int(x) for x in grid.view(-1))
        m = self.merge_size
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"not a grid of {m}x{m} merges")
        return t * h * w // (m * m)

    @cached_property
    def vision_tower(self) -> torch.nn.Module:
        """The whole model's tower when the model is (or will be) loaded for generation; else the
        tower alone, so an encode worker beside vLLM holds no second copy of the LM."""
        if not self.vision_only or "model" in self.__dict__:
            return self.model.model.visual
        return load_vision_tower(
            self.tower_class(),
            self.config.vision_config,
            self.ref.source,
            self.ref.revision,
            self.dtype,
            self.device,
        )

    def tower_class(self) -> Any:
        import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as qwen25
        import transformers.models.qwen2_vl.modeling_qwen2_vl as qwen2

        return (
            qwen2.Qwen2VisionTransformerPretrainedModel
            if self.family == "qwen2_vl"
            else qwen25.Qwen2_5_VisionTransformerPretrainedModel
        )

    def _tower_inputs(
        self, images: list[Image.Image], bounds: PixelBounds | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.processor.image_processor(
            images=images, return_tensors="pt", **self._size_kwargs(bounds)
        )
        return inputs["pixel_values"].to(self.device, self.dtype), inputs["image_grid_thw"].to(self.device)

    @torch.inference_mode()
    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]:
        pixels, grid = self._tower_inputs(images, bounds)
        merged = self.vision_tower(pixels, grid_thw=grid).pooler_output
        sizes = (grid.prod(-1) // self.merge_size**2).tolist()
        return [
            VisualTokens(
                embeds=chunk.to("cpu", self.dtype).clone(), grid_thw=g.view(1, 3).cpu().to(torch.int64)
            )
            for chunk, g in zip(torch.split(merged, sizes), grid, strict=True)
        ]

    add_special_tokens = False  # the chat template writes every special token itself

    def image_text(self, visual: VisualTokens | None) -> str:
        # <|vision_start|> and <|vision_end|> are the template's; the pads are one per token.
        return self.image_placeholder * (0 if visual is None else visual.num_tokens)

    def generation_inputs(self, prompts: list[list[int]], visuals: list[VisualTokens]) -> dict[str, Any]:
        input_ids, attention = self.left_padded(prompts)
        token_types = (input_ids == self.image_token_id).to(torch.int32) * IMAGE_TOKEN_TYPE
        return {
            "input_ids": input_ids,
            "attention_mask": attention,
            "mm_token_type_ids": token_types.to(self.device),
            "image_grid_thw": torch.cat([v.grid_thw for v in visuals]).to(self.device),
            # transformers puts these at the image-token positions instead of running the tower.
            "mm_encoder_outputs": self.mm_encoder_outputs(
                [v.embeds.to(self.dtype) for v in visuals], [dict(v.extras) for v in visuals]
            ),
        }

    # --- pruning and merging: M-RoPE positions, rows of the merged grid ----------------------

    def token_rows(self, visual: VisualTokens) -> list[int]:
        t, h, w = (int(x) for x in visual.grid_thw.view(-1))
        m = self.merge_size
        return [w // m] * (t * (h // m))

    def prompt_positions(self, inputs: dict[str, Any]) -> torch.Tensor:
        """(3, batch, length) M-RoPE positions, from the model's own get_rope_index."""
        positions, _ = self.model.model.get_rope_index(
            input_ids=inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs["attention_mask"],
        )
        return positions

    def vllm_image_data(self, visual: VisualTokens) -> dict[str, torch.Tensor]:
        # Embeddings-only input: 2-D merged embeddings + the (1, 3) grid that sizes the run.
        return {"image_embeds": visual.embeds, "image_grid_thw": visual.grid_thw}


class Qwen25VLAdapter(Qwen2VLAdapter):
    family = "qwen2_5_vl"
    model_class_name = "Qwen2_5_VLForConditionalGeneration"
