"""InternVL (InternVL3 / 3.5 in transformers' own implementation, `model_type` "internvl").

How it differs from the Qwen families, and how the interface carries it:

* the token rule cuts the image into a grid of square tiles chosen by aspect ratio (at most
  `max_patches`), plus a thumbnail of the whole image when there is more than one tile
  (``ingest.token_rules.DynamicTileRule``); the layout is (tile rows, tile columns), cached as
  ``grid_thw = [[1, rows, cols]]`` ((1, 1, 1): a single tile, no thumbnail);
* the tower is InternViT over each tile, its patches pixel-shuffled 2x2 (``downsample_ratio``)
  and projected by an MLP (``get_image_features``): every tile is ``image_seq_length`` tokens,
  the tiles of one image (thumbnail last) are cached as one entry;
* the prompt wraps the image's tokens in ``<img>`` ... ``</img>`` (the processor's own
  ``replace_image_token``); the markers are text tokens, counted as prompt tokens;
* the cached tokens go in at the ``<IMG_CONTEXT>`` positions through ``mm_encoder_outputs``,
  exactly as the pixel path does;
* positions are plain 1-D (a Qwen2 / Qwen3 language model), so pruning and merging keep each
  token's sequence position; a merge never joins two tiles, nor two rows of a tile
  (``token_rows``).

vLLM: see ``vllm_unsupported``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from PIL import Image

from ingest.budget import PixelBounds
from ingest.token_rules import DynamicTileRule
from worker.models.base import ModelAdapter
from worker.visual_tokens import TokenSpec, VisualTokens


class InternVLAdapter(ModelAdapter):
    family = "internvl"
    model_class_name = "InternVLForConditionalGeneration"

    @cached_property
    def processor(self) -> Any:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(self.ref.source, revision=self.ref.revision)
        if int(processor.image_seq_length) != self.tile_rule.image_seq_len:
            raise ValueError(
                f"the processor puts {processor.image_seq_length} tokens per tile in the prompt, the "
                f"model's tower makes {self.tile_rule.image_seq_len} (vision_config, downsample_ratio)"
            )
        return processor

    @cached_property
    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.ref.source, revision=self.ref.revision)

    @property
    def tile_rule(self) -> DynamicTileRule:
        rule = self.token_rule
        assert isinstance(rule, DynamicTileRule)
        return rule

    # --- token rule: ingest.token_rules.DynamicTileRule ----------------------------------------

    def _size_kwargs(self, bounds: PixelBounds | None) -> dict[str, Any]:
        # InternVLProcessor turns tiling on for every call (its defaults); the hub's image
        # processor files leave it off, so the encode asks for it as the processor does.
        bounds = self.token_geometry.normalize(bounds)
        return {"crop_to_patches": True, "max_patches": self.tile_rule.max_tiles_for(bounds)}

    def preprocessing(self, bounds: PixelBounds | None = None) -> dict[str, Any]:
        config = self.processor.image_processor.to_dict()
        config.update(self._size_kwargs(bounds))
        config["image_seq_length"] = self.tile_rule.image_seq_len
        return config

    # --- weights -----------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return int(self.config.text_config.hidden_size)

    def tokens_for_grid(self, grid: torch.Tensor) -> int:
        """Tokens of a (1, rows, cols) tile layout; ValueError for anything else."""
        t, rows, cols = (int(x) for x in grid.view(-1))
        if t != 1 or rows < 1 or cols < 1:
            raise ValueError("not a tile layout (1, rows, cols)")
        return self.tile_rule.tokens_for_tiles(rows, cols)

    @property
    def token_spec(self) -> TokenSpec:
        return TokenSpec(hidden_size=self.hidden_size, dtype=self.dtype, tokens_for_grid=self.tokens_for_grid)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @cached_property
    def model(self) -> torch.nn.Module:
        import transformers

        cls = getattr(transformers, self.model_class_name)
        model = cls.from_pretrained(self.ref.source, revision=self.ref.revision, dtype=self.dtype)
        return model.to(self.device).eval()

    @torch.inference_mode()
    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]:
        kwargs = self._size_kwargs(bounds)
        inputs = self.processor.image_processor(images=images, return_tensors="pt", **kwargs)
        counts = [int(n) for n in inputs["num_patches"]]
        grids = []
        for image, count in zip(images, counts, strict=True):
            rows, cols = self.tile_rule.tiles(image.width, image.height, bounds)
            grid = torch.tensor([[1, rows, cols]], dtype=torch.int64)
            if DynamicTileRule.slots(rows * cols) != count:  # the rule must be the processor's
                raise RuntimeError(
                    f"{image.width}x{image.height}: the processor made {count} tiles, the token rule "
                    f"{rows}x{cols} (+ thumbnail)"
                )
            grids.append(grid)
        features = self.model.model.get_image_features(
            pixel_values=inputs["pixel_values"].to(self.device, self.dtype)
        ).pooler_output  # (tiles of all images, tokens per tile, hidden)
        flat = features.reshape(-1, features.shape[-1])
        chunks = torch.split(flat, [self.tokens_for_grid(g) for g in grids])
        return [
            VisualTokens(embeds=chunk.to("cpu", self.dtype).clone(), grid_thw=grid)
            for chunk, grid in zip(chunks, grids, strict=True)
        ]

    @cached_property
    def image_token_id(self) -> int:
        return int(self.config.image_token_id)

    def template_ids(self, prompt: str, visual: VisualTokens | None) -> list[int]:
        processor = self.processor
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if text.count(processor.image_token) != 1 or processor.start_image_token in text:
            raise ValueError("the prompt must not contain image placeholder tokens")
        # The processor's own expansion of one image: <img>, image_seq_length ids per tile, </img>.
        tiles = 0 if visual is None else DynamicTileRule.slots(int(visual.grid_thw.view(-1)[1:].prod()))
        expanded = processor.replace_image_token({"num_patches": [tiles]}, 0)
        ids = self.tokenizer(text.replace(processor.image_token, expanded))["input_ids"]
        if visual is not None and ids.count(self.image_token_id) != visual.num_tokens:
            raise ValueError(
                f"the prompt has {ids.count(self.image_token_id)} image placeholders, "
                f"the visual tokens are {visual.num_tokens}"
            )
        return ids

    def generation_inputs(self, prompts: list[list[int]], visuals: list[VisualTokens]) -> dict[str, Any]:
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)  # left padding
            attention[row, width - len(ids) :] = 1
        return {
            "input_ids": input_ids.to(self.device),
            "attention_mask": attention.to(self.device),
            "mm_encoder_outputs": self.mm_encoder_outputs([v.embeds.to(self.dtype) for v in visuals], []),
        }

    def mm_encoder_outputs(
        self, embeds: list[torch.Tensor], extras: list[dict[str, torch.Tensor]]
    ) -> dict[str, Any]:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # One (tokens, hidden) tensor for the batch: InternVL scatters it over the <IMG_CONTEXT>
        # positions in order (its placeholder check counts elements, so any leading shape works).
        merged = torch.cat([e.to(self.device, self.dtype) for e in embeds])
        return {"image": BaseModelOutputWithPooling(pooler_output=merged)}

    def token_rows(self, visual: VisualTokens) -> list[int]:
        """Each tile's tokens are a square grid in row-major order (pixel shuffle keeps it)."""
        seq_len = self.tile_rule.image_seq_len
        side = round(seq_len**0.5)
        if side * side != seq_len:
            return [seq_len] * (visual.num_tokens // seq_len)  # not square: a tile is one row
        return [side] * (visual.num_tokens // side)
