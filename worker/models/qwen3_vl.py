"""Qwen3-VL (dense and MoE): Qwen2-VL's layout with 16-px patches and DEEPSTACK.

What differs from Qwen2-VL for visbatch:

* the token rule is the same smart_resize with 16-px patches merged 2x2 (32x32 px per token,
  ``ingest.token_rules``), and the M-RoPE index is computed by the model's own ``get_rope_index``;
* the tower returns, besides the merged embeddings, one feature map per ``deepstack`` block
  (``vision_config.deepstack_visual_indexes``, three in the released models): the language model
  ADDS feature map i to the hidden states at the image positions after decoder layer i. They
  are cached with the embeddings, in the same safetensors entry, as the extra ``deepstack``
  (layers, tokens, hidden), and injected exactly as the pixel path does, through
  ``mm_encoder_outputs`` (``BaseModelOutputWithDeepstackFeatures``);
* vLLM (0.32) takes them as ONE ``image_embeds`` tensor, the main embeddings and the deepstack
  maps concatenated along the hidden axis ((tokens, hidden x (1 + layers)), what its own tower
  returns), but only when the tower MODULE exists in the LLM: in the usual embeddings-only mode
  (``limit_mm_per_prompt`` image 0) vLLM does not build it, which turns deepstack off
  (``use_deepstack``), and it then generates without deepstack (not this model's output) or, fed
  the concatenation, crashes its engine. So for this family the LLM is built with images
  allowed in a prompt (``vllm_llm_options``, up to VLLM_MAX_IMAGES: a window's): the tower's
  weights are loaded (a few hundred MB for
  the released models), never run, since every request brings embeddings. Found by running it,
  and covered by ``tests/vllm/test_vllm_qwen3.py`` (token-for-token equal to transformers).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from PIL import Image

from ingest.budget import PixelBounds
from worker.models.qwen2_vl import Qwen2VLAdapter
from worker.tokens.tensors import TokenSpec, VisualTokens

DEEPSTACK = "deepstack"
# The most images in one prompt vLLM takes for this family (vllm_llm_options); vLLM's own
# default for a modality it is not told about.
VLLM_MAX_IMAGES = 999


class Qwen3VLAdapter(Qwen2VLAdapter):
    family = "qwen3_vl"
    model_class_name = "Qwen3VLForConditionalGeneration"

    @cached_property
    def _modeling(self) -> Any:
        import transformers.models.qwen3_vl.modeling_qwen3_vl as modeling

        return modeling

    def tower_class(self) -> Any:
        return self._modeling.Qwen3VLVisionModel

    @property
    def deepstack_layers(self) -> int:
        return len(self.config.vision_config.deepstack_visual_indexes)

    @property
    def token_spec(self) -> TokenSpec:
        width = int(self.config.vision_config.out_hidden_size)
        return TokenSpec(
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            tokens_for_grid=self.tokens_for_grid,
            extras={DEEPSTACK: (self.deepstack_layers, width)},
        )

    @torch.inference_mode()
    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]:
        pixels, grid = self._tower_inputs(images, bounds)
        out = self.vision_tower(pixels, grid_thw=grid)
        deepstack = torch.stack(list(out.deepstack_features))  # (layers, tokens of all images, hidden)
        sizes = (grid.prod(-1) // self.merge_size**2).tolist()
        return [
            VisualTokens(
                embeds=chunk.to("cpu", self.dtype).clone(),
                grid_thw=g.view(1, 3).cpu().to(torch.int64),
                extras={DEEPSTACK: deep.to("cpu", self.dtype).clone()},
            )
            for chunk, deep, g in zip(
                torch.split(out.pooler_output, sizes), torch.split(deepstack, sizes, dim=1), grid, strict=True
            )
        ]

    def mm_encoder_outputs(
        self, embeds: list[torch.Tensor], extras: list[dict[str, torch.Tensor]]
    ) -> dict[str, Any]:
        # As get_image_features gives them: per-image embeddings, and per deepstack layer the
        # per-image feature maps; the model concatenates both in image order.
        layers = [
            tuple(e[DEEPSTACK][i].to(self.device, self.dtype) for e in extras)
            for i in range(self.deepstack_layers)
        ]
        output = self._modeling.BaseModelOutputWithDeepstackFeatures(
            pooler_output=tuple(e.to(self.device, self.dtype) for e in embeds), deepstack_features=layers
        )
        return {"image": output}

    # --- vLLM ----------------------------------------------------------------------------------

    def vllm_llm_options(self) -> dict[str, Any]:
        # The tower module must exist for vLLM to apply deepstack (module docstring); it is never
        # run: every request brings embeddings. An image limit over 0 is also a count vLLM checks
        # (embeddings included): a window of up to this many pages or frames per prompt. Videos
        # stay off (visbatch sends frames as images).
        return {"limit_mm_per_prompt": {"image": VLLM_MAX_IMAGES, "video": 0}}

    def vllm_image_data(self, visual: VisualTokens) -> dict[str, torch.Tensor]:
        data = super().vllm_image_data(visual)
        # vLLM's Qwen3-VL splits [main | deepstack 1 | deepstack 2 ...] back along the hidden axis.
        data["image_embeds"] = torch.cat([visual.embeds, *visual.extras[DEEPSTACK]], dim=-1)
        return data


class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    family = "qwen3_vl_moe"
    model_class_name = "Qwen3VLMoeForConditionalGeneration"

    @cached_property
    def _modeling(self) -> Any:
        import transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe as modeling

        return modeling

    def tower_class(self) -> Any:
        return self._modeling.Qwen3VLMoeVisionModel
