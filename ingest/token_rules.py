"""How many visual tokens an image becomes, per model family, from the model's small JSON files.

Counting visual tokens is arithmetic on the processor's resize rule: ingest needs it for every
page and frame (to pack generation batches before any GPU work, and to enforce the token
budget), and the planner for every source it surveys. Neither may pay for torch and
transformers (seconds and most of a gigabyte per process), so the rule is computed here from
``config.json`` (the family) and ``preprocessor_config.json`` (patch and merge sizes, pixel
bounds) alone: a local folder, or just those files from the hub, cached by huggingface_hub.

The rule is exact, not an estimate: ``tests/test_token_rule.py`` checks it against the real
processor for random sizes, for every supported family.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ingest.anyres import AnyResRule
from ingest.budget import PixelBounds, TokenGeometry
from ingest.token_rule_base import TokenRule, UnsupportedModel

# Model types whose image processor resizes with Qwen2-VL's smart_resize (patch x merge grid).
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Model types whose image processor splits an image into square tiles plus a global view.
TILE_FAMILIES = ("idefics3",)
# Model types that tile an image into a grid chosen by aspect ratio, plus a thumbnail (InternVL).
DYNAMIC_TILE_FAMILIES = ("internvl",)
SUPPORTED_FAMILIES = QWEN_FAMILIES + TILE_FAMILIES
# LLaVA-OneVision: AnyRes grids of tiles + a base view (the rule: ingest.anyres).
ANYRES_FAMILIES = ("llava_onevision",)
SUPPORTED_FAMILIES += ANYRES_FAMILIES
SUPPORTED_FAMILIES += DYNAMIC_TILE_FAMILIES
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# Qwen2-VL's own defaults, used where a processor file leaves a value out.
DEFAULT_PATCH_SIZE = 14
DEFAULT_MERGE_SIZE = 2
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200
# Idefics3's own defaults (transformers' Idefics3ImageProcessor / Idefics3Processor).
DEFAULT_TILE_SIZE = 364
DEFAULT_TILE_LONGEST_EDGE = 4 * 364
TILE_MAX_IMAGE_SIZE = 4096  # Idefics3ImageProcessor's absolute cap on the resized image


class ModelFilesUnavailable(FileNotFoundError):
    """The model's config files cannot be read (no such folder, or the hub is unreachable)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule, as transformers implements it: both sides a multiple of `factor`,
    the area within [min_pixels, max_pixels], the aspect ratio kept as closely as possible.

    Raises ValueError for aspect ratios over 200, like the processor.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class SmartResizeRule(TokenRule):
    """Qwen-VL families: a grid of (patch x merge)-px cells, one visual token per cell."""

    family: str
    patch_size: int
    merge_size: int
    default: PixelBounds  # the processor's own resize bounds

    @property
    def factor(self) -> int:
        """Pixels per side of one visual token (Qwen2-VL: 14 x 2 = 28; Qwen3-VL: 16 x 2 = 32)."""
        return self.patch_size * self.merge_size

    @property
    def token_geometry(self) -> TokenGeometry:
        return TokenGeometry(token_pixels=self.factor * self.factor, default=self.default)

    def resized(self, width: int, height: int, bounds: PixelBounds | None = None) -> tuple[int, int]:
        """(width, height) the processor resizes an image to; ValueError for aspect ratios over 200."""
        b = bounds or self.default
        h, w = smart_resize(height, width, self.factor, b.min_pixels, b.max_pixels)
        return w, h

    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        w, h = self.resized(width, height, bounds)
        return (w // self.factor) * (h // self.factor)

    @classmethod
    def from_files(cls, family: str, data: dict[str, Any]) -> SmartResizeRule:
        size = data.get("size") or {}
        low = data.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS
        high = data.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
        return cls(
            family=family,
            patch_size=int(data.get("patch_size") or DEFAULT_PATCH_SIZE),
            merge_size=int(data.get("merge_size") or DEFAULT_MERGE_SIZE),
            default=PixelBounds(int(low), int(high)),
        )


def _rescale_to_longest(height: int, width: int, longest: int) -> tuple[int, int]:
    # Idefics3ImageProcessor: the longest side BECOMES `longest` (up or down), the other side
    # follows the aspect ratio, rounded to an even number, at least 1.
    aspect_ratio = width / height
    if width >= height:
        width = longest
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect_ratio)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, cap: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height and width > cap:
        width = cap
        height = int(width / aspect_ratio)
    elif height > width and height > cap:
        height = cap
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


@dataclass(frozen=True)
class TileRule(TokenRule):
    """Idefics3 (SmolDocling, granite-docling): the image's longest side is scaled to
    `longest_edge`, both sides are rounded UP to whole `tile`-px tiles, and each tile plus one
    global view of the whole image (only when there is more than one tile) becomes
    `image_seq_len` tokens.

    Budgets speak pixels (PixelBounds); here only `max_pixels` means something: it becomes the
    largest `longest_edge` (a whole number of tiles, at most the model's own) whose square image
    stays within it, counting the global view (see `longest_edge_for`). `min_pixels` has no
    effect: the processor always scales the longest side to `longest_edge`, up or down.
    """

    family: str
    tile: int  # px per side of one tile (max_image_size.longest_edge)
    image_seq_len: int  # tokens per tile
    longest_edge: int  # the processor's own size.longest_edge
    split: bool = True  # do_image_splitting

    @property
    def tile_pixels(self) -> int:
        return self.tile * self.tile

    def max_pixels_for(self, longest_edge: int) -> int:
        """The pixel bound that stands for `longest_edge`: a square image's tiles + global view."""
        side = math.ceil(longest_edge / self.tile)
        tiles = side * side + 1 if self.split and side > 1 else 1
        return tiles * self.tile_pixels

    def longest_edge_for(self, bounds: PixelBounds | None) -> int:
        """The processor's `size.longest_edge` under `bounds` (None: its own): the most whole
        tiles per side whose square image, global view included, stays within max_pixels."""
        if bounds is None or not self.split:
            return self.longest_edge
        slots = bounds.max_pixels // self.tile_pixels  # tiles, the global view included
        # Never above the model's own: the processor UPSCALES every image to this edge, so a
        # larger one would add tokens to every page, not just allow them for large ones.
        return min(max(1, math.isqrt(max(slots - 1, 1))) * self.tile, self.longest_edge)

    @property
    def default_max(self) -> int:
        return self.max_pixels_for(self.longest_edge)

    @property
    def token_geometry(self) -> TokenGeometry:
        return TokenGeometry(
            token_pixels=self.tile_pixels // self.image_seq_len,
            default=PixelBounds(self.tile_pixels, self.default_max),
        )

    def tiles(self, width: int, height: int, bounds: PixelBounds | None = None) -> tuple[int, int]:
        """(rows, cols) of tiles as the processor returns them; (0, 0): one tile, no global view."""
        if not self.split:
            return 0, 0
        h, w = _rescale_to_longest(height, width, self.longest_edge_for(bounds))
        h, w = _scale_below(h, w, TILE_MAX_IMAGE_SIZE)
        t = self.tile
        aspect_ratio = w / h
        if w >= h:
            w = math.ceil(w / t) * t
            h = math.ceil(int(w / aspect_ratio) / t) * t
        else:
            h = math.ceil(h / t) * t
            w = math.ceil(int(h * aspect_ratio) / t) * t
        if h > t or w > t:
            return math.ceil(h / t), math.ceil(w / t)
        return 0, 0

    def tokens_for_tiles(self, rows: int, cols: int) -> int:
        return (rows * cols + 1 if rows * cols else 1) * self.image_seq_len

    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        return self.tokens_for_tiles(*self.tiles(width, height, bounds))

    @classmethod
    def from_files(cls, family: str, data: dict[str, Any], config: dict[str, Any]) -> TileRule:
        size = data.get("size") or {}
        tile = (data.get("max_image_size") or {}).get("longest_edge") or DEFAULT_TILE_SIZE
        # Tokens per tile as the MODEL makes them (its processor's image_seq_len must agree):
        # (tile px / patch px)^2 patches, pixel-shuffled by scale_factor^2.
        vision = config.get("vision_config") or {}
        patches = int(vision.get("image_size") or tile) // int(vision.get("patch_size") or 14)
        seq_len = patches * patches // int(config.get("scale_factor") or 2) ** 2
        if seq_len < 1:
            raise UnsupportedModel(f"{family} vision config gives no tokens per tile: {vision}")
        return cls(
            family=family,
            tile=int(tile),
            image_seq_len=seq_len,
            longest_edge=int(size.get("longest_edge") or DEFAULT_TILE_LONGEST_EDGE),
            split=bool(data.get("do_image_splitting", True)),
        )


# InternVL's own defaults (GotOcr2ImageProcessor, InternVLConfig), where its files leave a value out.
DEFAULT_DYNAMIC_TILE = 448
DEFAULT_MAX_TILES = 12
# Max tiles (besides the thumbnail) each detail preset allows; None: the model's own max_patches.
DYNAMIC_DETAIL_TILES: dict[str, int | None] = {"low": 1, "medium": 4, "high": None}


def _tile_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    # GotOcr2ImageProcessor's get_all_supported_aspect_ratios: (columns, rows), fewest tiles first
    # (a stable sort: equal counts keep their loop order).
    grids = [
        (cols, rows)
        for cols in range(1, max_tiles + 1)
        for rows in range(1, max_tiles + 1)
        if min_tiles <= cols * rows <= max_tiles
    ]
    return sorted(grids, key=lambda g: g[0] * g[1])


def optimal_tile_grid(width: int, height: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows): the processor's get_optimal_tiled_canvas. The grid whose aspect ratio is
    closest to the image's; on a tie the later (larger) grid wins while the image's area is over
    half the grid's. No grid allowed (min over max): one tile."""
    aspect_ratio = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in _tile_grids(min_tiles, max_tiles):
        diff = abs(aspect_ratio - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


@dataclass(frozen=True)
class DynamicTileRule(TokenRule):
    """InternVL (InternVL3 / 3.5 as transformers implements them): the image is resized to a grid
    of `tile`-px tiles whose aspect ratio best matches it (between min_tiles and max_tiles
    tiles), plus one thumbnail of the whole image when the grid has more than one tile; every
    tile becomes `image_seq_len` tokens ((tile / patch)^2 patches, pixel-shuffled 2x2).

    Budgets speak pixels: `max_pixels` becomes the largest max_tiles whose worst case (that many
    tiles and the thumbnail) stays within it, never more than the model's own; a single tile when
    not even two tiles and a thumbnail fit (`max_tiles_for`). `min_pixels` has no effect (the
    processor always resizes to whole tiles). The detail presets choose max tiles too
    (`DYNAMIC_DETAIL_TILES`): `low` one tile, `medium` up to four and the thumbnail, `high` the
    model's own (12 and the thumbnail in the released models).
    """

    family: str
    tile: int  # px per side of one tile (the processor's size)
    image_seq_len: int  # tokens per tile
    min_tiles: int = 1  # min_patches
    max_tiles: int = DEFAULT_MAX_TILES  # max_patches

    @property
    def tile_pixels(self) -> int:
        return self.tile * self.tile

    @staticmethod
    def slots(max_tiles: int) -> int:
        """Tiles the model sees at most with `max_tiles`: the grid and its thumbnail."""
        return max_tiles + 1 if max_tiles > 1 else 1

    def max_tiles_for(self, bounds: PixelBounds | None) -> int:
        """The processor's max_patches under `bounds` (None: its own)."""
        if bounds is None:
            return self.max_tiles
        slots = bounds.max_pixels // self.tile_pixels
        return min(max(1, slots - 1) if slots >= 3 else 1, self.max_tiles)

    def max_pixels_for(self, max_tiles: int | None) -> int:
        """The max_pixels that stands for `max_tiles` (None: the model's own)."""
        tiles = self.max_tiles if max_tiles is None else min(max_tiles, self.max_tiles)
        return self.slots(tiles) * self.tile_pixels

    @property
    def token_geometry(self) -> TokenGeometry:
        presets = tuple((level, self.max_pixels_for(tiles)) for level, tiles in DYNAMIC_DETAIL_TILES.items())
        return TokenGeometry(
            token_pixels=self.tile_pixels // self.image_seq_len,
            default=PixelBounds(self.tile_pixels, self.max_pixels_for(None)),
            detail_pixels=presets,
        )

    def tiles(self, width: int, height: int, bounds: PixelBounds | None = None) -> tuple[int, int]:
        """(rows, columns) of the tile grid the processor cuts this image into (thumbnail aside)."""
        cols, rows = optimal_tile_grid(width, height, self.tile, self.min_tiles, self.max_tiles_for(bounds))
        return rows, cols

    def tokens_for_tiles(self, rows: int, cols: int) -> int:
        return self.slots(rows * cols) * self.image_seq_len

    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        return self.tokens_for_tiles(*self.tiles(width, height, bounds))

    @classmethod
    def from_files(cls, family: str, data: dict[str, Any], config: dict[str, Any]) -> DynamicTileRule:
        size = data.get("size") or {}
        tile = int(size.get("height") or size.get("shortest_edge") or DEFAULT_DYNAMIC_TILE)
        # Tokens per tile as the MODEL makes them (the processor's image_seq_length must agree):
        # (tile px / patch px)^2 patches, pixel-shuffled by downsample_ratio per side.
        vision = config.get("vision_config") or {}
        patch = vision.get("patch_size") or 14
        patch = int(patch[0] if isinstance(patch, list) else patch)
        ratio = float(config.get("downsample_ratio") or 0.5)
        seq_len = round((tile // patch) ** 2 * ratio * ratio)
        if seq_len < 1:
            raise UnsupportedModel(f"{family} vision config gives no tokens per tile: {vision}")
        return cls(
            family=family,
            tile=tile,
            image_seq_len=seq_len,
            min_tiles=int(data.get("min_patches") or 1),
            max_tiles=int(data.get("max_patches") or DEFAULT_MAX_TILES),
        )


def rule_from_files(config: dict[str, Any], processor: dict[str, Any]) -> TokenRule:
    """From the parsed config.json and preprocessor_config.json (or processor_config.json)."""
    family = str(config.get("model_type", ""))
    data = processor.get("image_processor", processor)
    if family in QWEN_FAMILIES:
        return SmartResizeRule.from_files(family, data)
    if family in TILE_FAMILIES:
        return TileRule.from_files(family, data, config)
    if family in ANYRES_FAMILIES:
        return AnyResRule.from_files(family, data, config)
    if family in DYNAMIC_TILE_FAMILIES:
        return DynamicTileRule.from_files(family, data, config)
    raise UnsupportedModel(
        f"model type {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
    )


def model_file(model: str, name: str, revision: str | None = None) -> Path | None:
    """A small file of the model: from its folder, or from the hub (cached; never weights).

    None when the model does not have that file. Raises ModelFilesUnavailable when the model
    cannot be reached at all (no such folder, or a hub id while the hub is unreachable).
    """
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / name
        return path if path.is_file() else None
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelFilesUnavailable(f"no model folder {model!r}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    # LocalEntryNotFoundError (not cached, or the hub unreachable) subclasses EntryNotFoundError
    # (the file does not exist) in huggingface_hub 1.x: it must be caught first.
    try:  # the cache first: no network round trip for a model used before
        return Path(hf_hub_download(model, name, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except EntryNotFoundError:
        return None
    except Exception:  # noqa: S110 - a corrupt cache entry: ask the hub below
        pass
    # huggingface_hub retries an unreachable hub for ~25 s, printing each retry: ask once, quickly.
    unreachable = hub_unreachable_reason()
    if unreachable is not None:
        raise ModelFilesUnavailable(
            f"model {model!r} is not on this machine and the model hub cannot be reached ({unreachable})"
        )
    try:
        return Path(hf_hub_download(model, name, revision=revision, etag_timeout=5))
    except LocalEntryNotFoundError as exc:
        raise _unreachable(model, name, exc) from exc
    except EntryNotFoundError:
        return None
    except Exception as exc:
        raise _unreachable(model, name, exc) from exc


def _unreachable(model: str, name: str, exc: Exception) -> ModelFilesUnavailable:
    return ModelFilesUnavailable(
        f"cannot read {name} of model {model!r} ({type(exc).__name__}); "
        "is the model hub reachable? Give a local model folder with --model (or VISBATCH_MODEL)"
    )


HUB_PROBE_TIMEOUT_S = 3.0


def hub_unreachable_reason() -> str | None:
    """Why the model hub cannot be reached (offline mode, no DNS, no route), or None: one TCP
    connection with a short timeout, instead of the hub client's retries."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlsplit(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{host}: {exc.strerror or type(exc).__name__}"
    return None


def read_json_file(model: str, name: str, revision: str | None = None) -> dict[str, Any] | None:
    path = model_file(model, name, revision)
    return None if path is None else json.loads(path.read_text())


@lru_cache(maxsize=16)
def load_token_rule(model: str, revision: str | None = None) -> TokenRule:
    """The token rule of `model` (hub id or folder) from its config and processor files."""
    config = read_json_file(model, "config.json", revision)
    if config is None:
        raise ModelFilesUnavailable(f"model {model!r} has no config.json")
    for name in PROCESSOR_FILES:
        processor = read_json_file(model, name, revision)
        if processor is not None:
            return rule_from_files(config, processor)
    raise ModelFilesUnavailable(f"model {model!r} has no {' or '.join(PROCESSOR_FILES)}")
