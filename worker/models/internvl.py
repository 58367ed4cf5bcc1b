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

**vLLM** (0.32) is not used for it, though it nearly works. It runs transformers' InternVL
checkpoints as its InternS1 model, whose prompt replacement accepts image embeddings (the run of
``<IMG_CONTEXT>`` as long as the embeddings, wrapped in ``<img>`` ... ``</img>`` by vLLM itself:
``vllm_prompt`` below sends ONE ``<IMG_CONTEXT>`` and the (1, tokens, hidden) tensor), and then
generates the transformers engine's tokens (tried on the tiny model in embeddings-only mode:
three 448x448 pages in one batch, then five sizes from 56x56 to 97x1500 one request at a time:
token for token equal). But it declares that input as ONE tensor per encoder batch
(``InternS1ImageEmbeddingInputs``: ``TensorShape("ni", "tifs", "hs")``, the token count not
dynamic), and its scheduler batches the images of every request that starts in the same step:
two pages of different tile grids (a 1280x720 and a 97x1500 page: 576 and 832 tokens) fail with
"ValueError: data contains inconsistent shapes: torch.Size([576, 128]) (index 0) vs
torch.Size([832, 128]) (index 1)" inside the engine core, which kills the engine
(EngineDeadError) for every request in flight; a server would die the same way on two clients'
pages. Tile grids vary with page sizes, so ``vllm`` (and ``openai``) are refused at job start with
that reason and ``auto`` picks transformers (``tests/vllm/test_engine_choice.py`` checks the
refusal and that vLLM still declares that shape). ``vision_tower`` (the tower and projector
alone) is what an encode worker beside vLLM would load.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from PIL import Image

from ingest.budget import PixelBounds
from ingest.token_rules import DynamicTileRule
from worker.models.base import TiledImageAdapter
from worker.tokens.tensors import VisualTokens


class InternVLAdapter(TiledImageAdapter):
    family = "internvl"
    model_class_name = "InternVLForConditionalGeneration"
    # vLLM takes its cached tokens of any size through visbatch's plugin (engines/vllm_models.py).
    vllm_unsupported = None
    vllm_needs_plugin = True

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

    def tokens_for_grid(self, grid: torch.Tensor) -> int:
        """Tokens of a (1, rows, cols) tile layout; ValueError for anything else."""
        t, rows, cols = (int(x) for x in grid.view(-1))
        if t != 1 or rows < 1 or cols < 1:
            raise ValueError("not a tile layout (1, rows, cols)")
        return self.tile_rule.tokens_for_tiles(rows, cols)

    @cached_property
    def vision_tower(self) -> torch.nn.Module:
        """The InternVLModel that runs `get_image_features` (tower, pixel shuffle, projector), without
        its language model where vLLM generates (ModelAdapter.inner_model_for_encoding)."""
        return self.inner_model_for_encoding("language_model")

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
        features = self.vision_tower.get_image_features(
            pixel_values=inputs["pixel_values"].to(self.device, self.dtype)
        ).pooler_output  # (tiles of all images, tokens per tile, hidden)
        flat = features.reshape(-1, features.shape[-1])
        chunks = torch.split(flat, [self.tokens_for_grid(g) for g in grids])
        return [
            VisualTokens(embeds=chunk.to("cpu", self.dtype).clone(), grid_thw=grid)
            for chunk, grid in zip(chunks, grids, strict=True)
        ]

    def reserved_markers(self) -> list[str]:
        return [self.image_placeholder, self.processor.start_image_token]

    def image_text(self, visual: VisualTokens | None) -> str:
        # The processor's own expansion of one image: <img>, image_seq_length ids per tile, </img>.
        tiles = 0 if visual is None else DynamicTileRule.slots(int(visual.grid_thw.view(-1)[1:].prod()))
        return self.processor.replace_image_token({"num_patches": [tiles]}, 0)

    # --- vLLM (through visbatch's plugin: worker.engines.vllm_models) --------------------------

    def vllm_image_span(self, prompt_ids: list[int], first: int, last: int) -> tuple[int, int]:
        """`<img>`, the run of `<IMG_CONTEXT>` ids and `</img>`: vLLM's processor expands ONE
        `<IMG_CONTEXT>` to the whole wrapped run itself (from the embeddings' length)."""
        processor = self.processor
        if (
            first < 1
            or prompt_ids[first - 1] != processor.start_image_token_id
            or last + 1 >= len(prompt_ids)
            or prompt_ids[last + 1] != processor.end_image_token_id
        ):
            raise ValueError("the image placeholders are not wrapped in <img> ... </img>")
        return first - 1, last + 1
