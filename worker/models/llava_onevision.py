"""LLaVA-OneVision (llava-hf/llava-onevision-qwen2-0.5b / 7b / 72b-ov-hf): SigLIP, an MLP projector, AnyRes.

How it differs from the other families, and how the interface carries it:

* the token rule (``ingest.anyres.AnyResRule``) picks a grid of tiles from
  ``image_grid_pinpoints``, encodes every tile and one base view of the whole image, cuts the
  padding off the tiles' feature map, interpolates it down when it is over ``anyres_max_N``
  tiles' worth, and appends the learned ``image_newline`` after every row of it;
* the cached tokens are exactly what goes in at the ``<image>`` positions: the base view's
  features, then the map's rows each followed by its newline embedding (the model's own
  ``pack_image_features``, run here on the projector's output, so unpadding, interpolation and
  newlines are all in the cache). The layout is the map's (rows, cols): ``grid_thw = [[1, rows,
  cols]]``, and tokens = side^2 + rows x (cols + 1);
* the prompt is the chat template with its one ``<image>`` expanded to that many ``<image>``
  ids (the processor's ``replace_image_token`` repeats the token, nothing else);
* positions are plain 1-D (a Qwen2 language model), so pruning and merging keep each token's
  sequence position; ``token_rows`` gives the base view's rows, then each map row and its newline
  as separate rows, so a merge never joins two rows, a row and its newline, or the base view and
  the map;
* budgets choose the grids (``pinpoints_for``): the encode passes them to the image processor
  and packs with them, as the model would with those ``image_grid_pinpoints``.

**A window of several pages or frames** (``--window``): the processor shows each image of a
prompt of several on ONE view (``batch_num_images`` > 1: padded to a square with the image
mean, resized to one tile, no AnyRes map), so such an image has a second cache entry, its window
view (``encode_window_view``: a tile's features and the newline, layout ``WINDOW_VIEW_GRID``),
encoded beside the usual one for a job whose windows hold several units; a window of one image
shows the usual view, as the processor does.

**Video frames are encoded as images.** OneVision's own video path (``<video>``: frames bilinearly
pooled 2x2 to ceil(side/2)^2 tokens each, ONE newline after the last frame) pools a whole clip
into one prompt. visbatch's unit is one sampled frame, cached under its own pixel hash and asked
on its own, so a frame is one image prompt: AnyRes tiles, base view and newlines, like a page
(what the processor does with a frame passed as an image; ``tests/test_cached_equals_pixels.py``
checks it from pixels). A frame cached that way is also shared with the same image anywhere
else. The cost: never less than one tile and the base view, e.g. 1,317 tokens for a 320x240
frame on the released models (384-px tiles), where their video path spends 196 per frame.

**vLLM** (0.32) takes ``image_embeds`` of shape (features, LM width) per image, puts them in
unchanged and expands the prompt's one ``<image>`` to the tensor's length
(``ModelAdapter.vllm_prompt`` builds exactly that), and generates the transformers engine's
tokens. Its own class declares that input as ONE tensor per encoder batch, so two images of
different token counts in one step killed its engine ("data contains inconsistent shapes");
visbatch's vLLM plugin (``worker.engines.vllm_models``) relaxes that one declaration
(``tests/vllm/test_vllm_plugin_families.py``).
"""

from __future__ import annotations

from functools import cached_property
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image

from ingest.anyres import AnyResRule
from ingest.budget import PixelBounds
from worker.models.base import ModelAdapter
from worker.tokens.tensors import VisualTokens

# The layout (grid_thw) of an image's window view: no feature map, a tile and its newline.
WINDOW_VIEW_GRID = (1, 0, 0)


class LlavaOnevisionAdapter(ModelAdapter):
    family = "llava_onevision"
    model_class_name = "LlavaOnevisionForConditionalGeneration"
    # vLLM takes its cached tokens of any size through visbatch's plugin (engines/vllm_models.py).
    vllm_unsupported = None
    vllm_needs_plugin = True

    @property
    def anyres_rule(self) -> AnyResRule:
        rule = self.token_rule
        assert isinstance(rule, AnyResRule)
        return rule

    # --- token rule: ingest.anyres.AnyResRule ----------------------------------------------

    def pinpoints_for(self, bounds: PixelBounds | None) -> list[list[int]]:
        return [list(p) for p in self.anyres_rule.pinpoints_for(self.token_geometry.normalize(bounds))]

    def _size_kwargs(self, bounds: PixelBounds | None) -> dict[str, Any]:
        bounds = self.token_geometry.normalize(bounds)
        return {} if bounds is None else {"image_grid_pinpoints": self.pinpoints_for(bounds)}

    def preprocessing(self, bounds: PixelBounds | None = None) -> dict[str, Any]:
        config = self.processor.image_processor.to_dict()
        config.update(self._size_kwargs(bounds))
        # What shapes the tokens besides the pixels: the feature layer and the interpolation cap.
        config["vision_feature_layer"] = self.config.vision_feature_layer
        config["vision_aspect_ratio"] = self.config.vision_aspect_ratio
        return config

    # --- weights -----------------------------------------------------------------------

    def tokens_for_grid(self, grid: torch.Tensor) -> int:
        """Tokens of a (1, rows, cols) feature map, or of the window view (1, 0, 0): one square
        tile and its newline; ValueError for any other layout."""
        t, rows, cols = (int(x) for x in grid.view(-1))
        if (t, rows, cols) == WINDOW_VIEW_GRID:
            return self.anyres_rule.window_view_tokens
        if t != 1 or rows < 1 or cols < 1:
            raise ValueError("not a feature map layout (1, rows, cols)")
        return self.anyres_rule.tokens_for_map(rows, cols)

    @cached_property
    def vision_tower(self) -> SimpleNamespace:
        """The tower, the projector and image_newline: the whole model's when it is (or will be)
        loaded for generation; else those three alone on the device (an encode worker beside
        vLLM), read through a CPU load of the checkpoint so that every published key layout
        maps the way transformers maps it, the language model then dropped."""
        if not self.vision_only or "model" in self.__dict__:
            inner = self.model.model
            return SimpleNamespace(
                tower=inner.vision_tower, projector=inner.multi_modal_projector, newline=inner.image_newline
            )
        import transformers

        cls = getattr(transformers, self.model_class_name)
        whole = cls.from_pretrained(self.ref.source, revision=self.ref.revision, dtype=self.dtype).eval()
        inner = whole.model
        parts = SimpleNamespace(
            tower=inner.vision_tower.to(self.device),
            projector=inner.multi_modal_projector.to(self.device),
            newline=inner.image_newline.detach().to(self.device),
        )
        del whole, inner
        return parts

    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Projected tower features of a batch of tiles, as get_image_features selects them."""
        layer = self.config.vision_feature_layer
        hidden = self.vision_tower.tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
        selected = hidden[layer] if isinstance(layer, int) else torch.cat([hidden[i] for i in layer], dim=-1)
        return self.vision_tower.projector(selected)

    @torch.inference_mode()
    def encode(self, images: list[Image.Image], bounds: PixelBounds | None = None) -> list[VisualTokens]:
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

        rule, bounds = self.anyres_rule, self.token_geometry.normalize(bounds)
        size = self._size_kwargs(bounds)
        inputs = self.processor.image_processor(images=images, return_tensors="pt", **size)
        sizes = inputs["image_sizes"]  # (images, 2): height, width of each original image
        counts = [rule.tiles(int(w), int(h), bounds) for h, w in sizes.tolist()]
        # pixel_values is padded to the most tiles of the batch: each image keeps its own.
        pixels = torch.cat([pv[:n] for pv, n in zip(inputs["pixel_values"], counts, strict=True)])
        features = torch.split(self._features(pixels.to(self.device, self.dtype)), counts)
        # The model's own packing (unpad, interpolate, newlines, base view first), with the grids
        # this job allows: it reads only these three config values.
        packing = SimpleNamespace(
            config=SimpleNamespace(
                vision_config=self.config.vision_config, image_grid_pinpoints=self.pinpoints_for(bounds)
            )
        )
        packed, _ = LlavaOnevisionModel.pack_image_features(
            packing,  # type: ignore[arg-type]
            list(features),
            sizes,
            image_newline=self.vision_tower.newline,
            vision_aspect_ratio=self.config.vision_aspect_ratio,
        )
        out = []
        for embeds, (h, w) in zip(packed, sizes.tolist(), strict=True):
            rows, cols = rule.feature_map(int(w), int(h), bounds)
            expected = rule.tokens_for_map(rows, cols)
            if embeds.shape[0] != expected:
                raise RuntimeError(f"packed {embeds.shape[0]} tokens where the token rule says {expected}")
            grid = torch.tensor([[1, rows, cols]], dtype=torch.int64)
            out.append(VisualTokens(embeds=embeds.to("cpu", self.dtype).clone(), grid_thw=grid))
        return out

    @torch.inference_mode()
    def encode_window_view(
        self, images: list[Image.Image], bounds: PixelBounds | None = None
    ) -> list[VisualTokens]:
        """Each image as the processor shows it in a prompt of several (`batch_num_images` > 1):
        padded to a square with the image mean, resized to one tile, no AnyRes map; the model
        then appends one newline. The job's bounds do not change it (the processor's either)."""
        # A sample of several images takes that path; a lone image is sent with a copy of itself.
        sample = images if len(images) > 1 else images * 2
        inputs = self.processor.image_processor(images=[sample], return_tensors="pt")
        pixels = inputs["pixel_values"][: len(images), 0]  # (images, 1 view, 3, tile, tile) -> one each
        features = self._features(pixels.to(self.device, self.dtype))  # (images, side^2, hidden)
        newline = self.vision_tower.newline.to(features.dtype)[None]
        grid = torch.tensor([WINDOW_VIEW_GRID], dtype=torch.int64)
        return [
            VisualTokens(embeds=torch.cat([f, newline]).to("cpu", self.dtype).clone(), grid_thw=grid.clone())
            for f in features
        ]

    def reserved_markers(self) -> list[str]:
        return [self.image_placeholder, self.processor.video_token]

    def image_text(self, visual: VisualTokens | None) -> str:
        # The processor's expansion of one image: its <image> repeated once per visual token.
        return self.image_placeholder * (0 if visual is None else visual.num_tokens)

    def token_rows(self, visual: VisualTokens) -> list[int]:
        """The base view's rows, then each map row and, alone, its newline (a row of 1 never
        merges); the window view: its tile's rows and its newline."""
        _, rows, cols = (int(x) for x in visual.grid_thw.view(-1))
        side = self.anyres_rule.side
        if rows == 0:
            return [side] * side + [1]
        return [side] * side + [cols, 1] * rows
