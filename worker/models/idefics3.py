"""Idefics3: SmolDocling-256M and granite-docling-258M (docling's VLM pipeline), Idefics3-8B.

How it differs from the Qwen families, and how the interface carries it:

* the token rule splits the image into square tiles plus a global view (``ingest.token_rules.
  TileRule``): the layout is (tile rows, tile columns), cached as ``grid_thw = [[1, rows, cols]]``
  ((1, 0, 0): a single tile, no global view, as the processor reports it);
* the prompt depends on that layout, not only on the token count: every tile is announced with
  ``<fake_token_around_image><row_i_col_j>`` and the global view with ``<global-img>``, so
  ``prompt_ids`` takes the visual tokens and builds the text with the processor's own
  ``replace_image_token``;
* the tower is SigLIP over each tile, pixel-shuffled by ``scale_factor``^2 and projected
  (``get_image_features``); its output goes in at the ``<image>`` positions through
  ``mm_encoder_outputs``, exactly as the pixel path does;
* positions are plain 1-D (a Llama language model), so pruning and merging keep each token's
  sequence position; a merge never joins two tiles, nor two rows of a tile (``token_rows``).

vLLM (0.32) builds each image's prompt replacement from the image itself, so its own Idefics3
refuses embeddings ("Expected type: ImageProcessorItems, but found type: ImageEmbeddingItems").
visbatch's vLLM plugin (``worker.engines.vllm_models``) takes an image as its embeddings and its
tile grid (``vllm_image_data``) and writes the replacement from the grid with vLLM's own code;
the prompt sent carries ONE ``<image>`` per image (``collapse_image_placeholders``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
from PIL import Image

from ingest.budget import PixelBounds
from ingest.token_rules import TileRule
from worker.models.base import TiledImageAdapter
from worker.tokens.tensors import VisualTokens


class Idefics3Adapter(TiledImageAdapter):
    family = "idefics3"
    model_class_name = "Idefics3ForConditionalGeneration"
    # vLLM takes its cached tokens with their tile grid through visbatch's plugin (module docstring).
    vllm_unsupported = None
    vllm_needs_plugin = True

    @property
    def tile_rule(self) -> TileRule:
        rule = self.token_rule
        assert isinstance(rule, TileRule)
        return rule

    # --- token rule: ingest.token_rules.TileRule ----------------------------------------------

    def _size_kwargs(self, bounds: PixelBounds | None) -> dict[str, Any]:
        bounds = self.token_geometry.normalize(bounds)
        return {} if bounds is None else {"size": {"longest_edge": self.tile_rule.longest_edge_for(bounds)}}

    def preprocessing(self, bounds: PixelBounds | None = None) -> dict[str, Any]:
        config = self.processor.image_processor.to_dict()
        config.update(self._size_kwargs(bounds))
        config["image_seq_len"] = self.tile_rule.image_seq_len
        return config

    # --- weights -----------------------------------------------------------------------

    def tokens_for_grid(self, grid: torch.Tensor) -> int:
        """Tokens of a (1, rows, cols) tile layout; ValueError for a layout the processor cannot make."""
        t, rows, cols = (int(x) for x in grid.view(-1))
        if t != 1 or rows < 0 or cols < 0 or (rows == 0) != (cols == 0) or rows * cols == 1:
            raise ValueError("not a tile layout (1, rows, cols)")
        return self.tile_rule.tokens_for_tiles(rows, cols)

    @cached_property
    def vision_tower(self) -> torch.nn.Module:
        """The Idefics3Model that runs `get_image_features` (tower, pixel shuffle, connector), without
        its language model where vLLM generates (ModelAdapter.inner_model_for_encoding)."""
        return self.inner_model_for_encoding("text_model")

    @torch.inference_mode()
    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]:
        # One sample per image, so that every image's tiles come back as one feature run.
        inputs = self.processor.image_processor(
            images=[[image] for image in images],
            return_tensors="pt",
            return_row_col_info=True,
            **self._size_kwargs(bounds),
        )
        features = self.vision_tower.get_image_features(
            inputs["pixel_values"].to(self.device, self.dtype),
            inputs["pixel_attention_mask"].to(self.device),
        ).pooler_output
        # (tiles, tokens per tile, hidden) in transformers 5.19, a list per image in 5.20: either
        # way the tiles of all images, in order; each image takes its own layout's share.
        flat = (
            torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
            if isinstance(features, (list, tuple))
            else features.reshape(-1, features.shape[-1])
        )
        grids = [
            torch.tensor([[1, rows[0], cols[0]]], dtype=torch.int64)
            for rows, cols in zip(inputs["rows"], inputs["cols"], strict=True)
        ]
        chunks = torch.split(flat, [self.tokens_for_grid(g) for g in grids])
        return [
            VisualTokens(embeds=chunk.to("cpu", self.dtype).clone(), grid_thw=grid)
            for chunk, grid in zip(chunks, grids, strict=True)
        ]

    # --- vLLM ----------------------------------------------------------------------------

    def vllm_image_data(self, visual: VisualTokens) -> dict[str, torch.Tensor]:
        # The embeddings and the tile grid vLLM writes the image's prompt from (the plugin's
        # `image_grid`).
        return {"image_embeds": visual.embeds, "image_grid": visual.grid_thw}

    def collapse_image_placeholders(self, prompt_ids: list[int], images: Sequence[VisualTokens]) -> list[int]:
        """Each image's whole expansion (tile tags, the global view and their `<image>` runs)
        collapsed to ONE `<image>`: vLLM writes it again from the grid. ValueError when the
        prompt does not hold the images' expansions in order."""
        out: list[int] = []
        at = 0
        for i, visual in enumerate(images):
            span = self._image_ids(visual)
            start = _find(prompt_ids, span, at)
            if start < 0 or self.image_token_id in prompt_ids[at:start]:
                raise ValueError(
                    f"the prompt does not hold image {i + 1}'s tile layout {visual.grid_thw.tolist()} next"
                )
            out += prompt_ids[at:start] + [self.image_token_id]
            at = start + len(span)
        if self.image_token_id in prompt_ids[at:]:
            raise ValueError(f"the prompt has image placeholders beyond its {len(images)} image(s)")
        return out + prompt_ids[at:]

    def _image_ids(self, visual: VisualTokens) -> list[int]:
        """The token ids of an image's expansion, tokenized once per tile layout (every request of
        a vLLM batch looks its images' up: the same few layouts over and over)."""
        layout = tuple(int(x) for x in visual.grid_thw.view(-1))
        spans = self.__dict__.setdefault("_image_spans", {})
        if layout not in spans:
            spans[layout] = self.tokenizer.encode(self.image_text(visual), add_special_tokens=False)
        return spans[layout]

    def image_text(self, visual: VisualTokens | None) -> str:
        processor = self.processor
        _, rows, cols = (0, 0, 0) if visual is None else (int(x) for x in visual.grid_thw.view(-1))
        # The processor's own expansion of one image: tile markers, then image_seq_len <image> each.
        expanded = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
        return expanded if visual is not None else expanded.replace(processor.image_token, "")


def _find(ids: list[int], span: list[int], start: int) -> int:
    """Where `span` first starts in `ids` at or after `start`; -1 when it does not."""
    first = span[0]
    for i in range(start, len(ids) - len(span) + 1):
        if ids[i] == first and ids[i : i + len(span)] == span:
            return i
    return -1
