"""LLaVA-OneVision's token rule (AnyRes), from the model's JSON files alone: no torch.

What transformers' LlavaOnevisionProcessor counts and LlavaOnevisionModel.pack_image_features
builds, for ONE image per prompt (the only way visbatch asks):

1. the best grid: of ``image_grid_pinpoints`` (height, width), the one that keeps most of the
   image's pixels when the image is fitted into it, then the one that wastes least
   (``select_best_resolution``);
2. the image, fitted and padded to that grid, is cut into ``tile``-px tiles; each tile, and one
   base view of the whole image squashed to a single tile, becomes ``side`` x ``side`` SigLIP
   features, projected to the LM width;
3. the tiles' features form one (rows x side, cols x side) map, from which the rows or columns
   that only show padding are cut (``unpad_image``);
4. a map over ``anyres_max_N`` tiles' worth (by more than 10 %) is interpolated down to about N
   tiles' worth (bilinear);
5. ``image_newline`` is appended after every row of the map; the base view's features come
   first: tokens = side^2 + rows x (cols + 1).

The layout cached with the tokens is that map's (rows, cols) after steps 3-4.

Budgets speak pixels (``PixelBounds``); here ``max_pixels`` / ``token_pixels`` (the pixels of a
tile over its tokens) is a token cap, and it chooses the grids allowed: those whose most tokens
(base view, every tile, a newline per feature row, before the padding is cut; over
``anyres_max_N`` the interpolated bound) fit in it (``AnyResRule.pinpoints_for``). The smallest
grid (one tile) always stays, so only a cap under one tile and the base view is overshot.
``min_pixels`` has no effect (the image is always fitted to a grid). The detail presets choose
grids too (``AnyResRule.token_geometry``): ``low`` one tile, ``medium`` up to four, ``high`` the
model's own grids (the model itself shrinks a map over ``anyres_max_N`` tiles' worth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ingest.budget import PixelBounds, TokenGeometry
from ingest.token_rule_base import TokenRule, UnsupportedModel

# Tiles (besides the base view) each preset allows; None: the model's own grids.
DETAIL_TILES: dict[str, int | None] = {"low": 1, "medium": 4, "high": None}
# transformers' LlavaOnevisionImageProcessor default: every a x b grid of 384-px tiles up to 6 x 6.
DEFAULT_TILE = 384
DEFAULT_PINPOINTS = tuple((384 * a, 384 * b) for a in range(1, 7) for b in range(1, 7))


Pinpoints = tuple[tuple[int, int], ...]


def select_best_resolution(height: int, width: int, pinpoints: Pinpoints) -> tuple[int, int]:
    """(height, width) of the grid transformers' select_best_resolution picks: the most of the
    image's own pixels kept when fitted in, then the least padding; the first one on a tie."""
    best, best_effective, best_wasted = pinpoints[0], 0, math.inf
    for grid_h, grid_w in pinpoints:
        scale = min(grid_w / width, grid_h / height)
        fitted_w, fitted_h = int(width * scale), int(height * scale)
        effective = min(fitted_w * fitted_h, width * height)
        wasted = grid_w * grid_h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (grid_h, grid_w), effective, wasted
    return best


def unpadded_map(height: int, width: int, rows: int, cols: int, max_tiles: int, side: int) -> tuple[int, int]:
    """(rows, cols) of the feature map of a (rows x cols)-feature grid for a `height` x `width`
    image once its padding is cut and, over `max_tiles` tiles' worth, interpolated down."""
    if width / height > cols / rows:  # wider than the grid: padding above and below
        new_height = int(round(height * (cols / width), 7))
        rows -= (rows - new_height) // 2 * 2
    else:
        new_width = int(round(width * (rows / height), 7))
        cols -= (cols - new_width) // 2 * 2
    ratio = math.sqrt(rows * cols / (max_tiles * side**2))
    if ratio > 1.1:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


@dataclass(frozen=True)
class AnyResRule(TokenRule):
    """LLaVA-OneVision: AnyRes tiles + a base view + image_newline per row (module docstring)."""

    family: str
    tile: int  # px per side of one tile (the image processor's size)
    side: int  # features per tile side (the tower's image_size / patch_size)
    pinpoints: Pinpoints  # (height, width) of every grid allowed
    max_tiles: int  # anyres_max_N

    @property
    def tile_pixels(self) -> int:
        return self.tile * self.tile

    @property
    def tokens_per_tile(self) -> int:
        return self.side * self.side

    @property
    def token_pixels(self) -> int:
        return self.tile_pixels // self.tokens_per_tile

    def grid_tokens(self, pinpoint: tuple[int, int]) -> int:
        """The most tokens an image fitted to this grid can become: the base view, the map with
        no padding cut (or, past anyres_max_N by 10 %, what the interpolation can leave: the map
        is at most 1.21 x N tiles' worth just under that line, N tiles' worth over it), a
        newline per feature row."""
        rows, cols = pinpoint[0] // self.tile * self.side, pinpoint[1] // self.tile * self.side
        most = math.floor(1.1**2 * self.max_tiles * self.tokens_per_tile) + 1
        return self.tokens_per_tile + min(rows * cols, most) + rows

    def grid_pixels(self, pinpoint: tuple[int, int]) -> int:
        """The max_pixels a grid needs to be allowed: its most tokens, in pixels."""
        return self.grid_tokens(pinpoint) * self.token_pixels

    @property
    def default_max(self) -> int:
        return max(self.grid_pixels(p) for p in self.pinpoints)

    def pinpoints_for(self, bounds: PixelBounds | None) -> Pinpoints:
        """The grids allowed under `bounds` (None: the model's own): those whose most tokens fit
        in max_pixels / token_pixels; at least the smallest grid."""
        if bounds is None:
            return self.pinpoints
        cap = bounds.max_pixels // self.token_pixels
        allowed = tuple(p for p in self.pinpoints if self.grid_tokens(p) <= cap)
        return allowed or (min(self.pinpoints, key=self.grid_tokens),)

    def detail_max_pixels(self, tiles: int | None) -> int:
        """max_pixels that allows every grid of at most `tiles` tiles (None: all of them)."""
        grids = [
            p for p in self.pinpoints if tiles is None or (p[0] // self.tile) * (p[1] // self.tile) <= tiles
        ]
        return max(self.grid_pixels(p) for p in grids or self.pinpoints)

    @property
    def token_geometry(self) -> TokenGeometry:
        presets = tuple((level, self.detail_max_pixels(tiles)) for level, tiles in DETAIL_TILES.items())
        return TokenGeometry(
            token_pixels=self.token_pixels,
            default=PixelBounds(self.tile_pixels, self.default_max),
            detail_pixels=presets,
        )

    def feature_map(self, width: int, height: int, bounds: PixelBounds | None = None) -> tuple[int, int]:
        """(rows, cols) of the image's feature map, newlines aside (the cached layout)."""
        grid_h, grid_w = select_best_resolution(height, width, self.pinpoints_for(bounds))
        rows, cols = grid_h // self.tile * self.side, grid_w // self.tile * self.side
        return unpadded_map(height, width, rows, cols, self.max_tiles, self.side)

    def tiles(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        """Tiles the tower encodes for this image, the base view included."""
        grid_h, grid_w = select_best_resolution(height, width, self.pinpoints_for(bounds))
        return math.ceil(grid_h / self.tile) * math.ceil(grid_w / self.tile) + 1

    def tokens_for_map(self, rows: int, cols: int) -> int:
        return self.tokens_per_tile + rows * (cols + 1)

    @property
    def window_view_tokens(self) -> int:
        # In a prompt of several images the processor shows each on ONE view, padded to a square
        # and resized to one tile, no AnyRes map: a tile's features and one newline.
        return self.tokens_per_tile + 1

    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        return self.tokens_for_map(*self.feature_map(width, height, bounds))

    @classmethod
    def from_files(cls, family: str, data: dict[str, Any], config: dict[str, Any]) -> AnyResRule:
        size = data.get("size") or {}
        tile = int(size.get("height") or size.get("shortest_edge") or DEFAULT_TILE)
        vision = config.get("vision_config") or {}
        side = int(vision.get("image_size") or DEFAULT_TILE) // int(vision.get("patch_size") or 14)
        # The MODEL's grids and cap (config.json) place the features; the processor's must agree.
        pinpoints = config.get("image_grid_pinpoints") or data.get("image_grid_pinpoints")
        pinpoints = tuple((int(h), int(w)) for h, w in pinpoints) if pinpoints else DEFAULT_PINPOINTS
        aspect = str(config.get("vision_aspect_ratio") or "anyres_max_9")
        strategy = config.get("vision_feature_select_strategy") or "full"
        if not aspect.startswith("anyres_max_") or not aspect[len("anyres_max_") :].isdigit():
            raise UnsupportedModel(f"{family}: vision_aspect_ratio {aspect!r} is not anyres_max_N")
        if strategy != "full":
            # SigLIP has no CLS token to drop: "default" cannot make a square map per tile.
            raise UnsupportedModel(f"{family}: vision_feature_select_strategy {strategy!r} (only 'full')")
        if side < 1 or any(h % tile or w % tile for h, w in pinpoints):
            raise UnsupportedModel(f"{family}: grids {pinpoints} are not whole {tile}-px tiles")
        max_tiles = int(aspect[len("anyres_max_") :])
        return cls(family=family, tile=tile, side=side, pinpoints=pinpoints, max_tiles=max_tiles)
