"""The visual-token budget of a job: how many tokens each page or frame may cost.

Everything here is model-agnostic arithmetic on pixel bounds; the model adapter supplies its
token geometry (pixels per visual token, the processor's own bounds) and its resize rule.

* **Detail presets** cap the tokens of every image by lowering the processor's ``max_pixels``
  (Qwen2-VL: ``size={"shortest_edge": min_pixels, "longest_edge": max_pixels}``), so fewer
  tokens come out of the vision tower and reach the language model: the count at ingest, the
  encode and generation all use the same bounds, and the bounds are part of the cache key.
* ``auto`` picks a preset from the prompts (and the JSON schema's field names): fine text
  (totals, dates, reading, OCR-like words) gets ``high``; only coarse questions (scene,
  category, describe, what kind) get ``low``; anything else ``medium``.
* Explicit ``min_pixels`` / ``max_pixels`` override the preset's bounds; a per-frame token cap
  lowers ``max_pixels`` further; a per-video cap lowers it for the frames of one video.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Detail = Literal["low", "medium", "high", "auto"]
Level = Literal["low", "medium", "high"]

# Tokens per image at most, per preset. 1280 is the Qwen2-VL model card's suggested maximum
# (max_pixels = 1280 * 28 * 28) and the tiny test model's processor default; the real
# Qwen2-VL-2B processor allows up to 16384 tokens per image when no detail is asked for.
DETAIL_TOKENS: dict[str, int] = {"low": 256, "medium": 640, "high": 1280}

# 32x32 RGB thumbnails, mean absolute difference in levels (0-255): below this a frame is a
# near-duplicate of the last kept one. Measured on synthetic MPEG-4 clips: a static smooth
# scene 0-1.9 (encoder noise, keyframe changes), a static random-noise texture up to 4.9 (the
# worst case for a codec: such frames are kept, the safe mistake), a 60x60 px object moving
# in a 320x240 frame 4.5-11.
DEFAULT_REDUNDANCY_THRESHOLD = 3.0


def _wordset(words: str) -> frozenset[str]:
    return frozenset(words.split())


# Words that ask for fine detail (reading text or numbers) or only for the gist of a picture.
FINE_WORDS = _wordset(
    """total amount date read transcribe transcription text table number numeric invoice receipt ocr
    extract price cost sum tax vat digit value address phone email serial code field quote caption
    label spell word written handwriting handwritten account iban due balance percent percentage chart
    graph axis paragraph title heading"""
)
COARSE_WORDS = _wordset(
    """scene category categorize categorise classify describe description kind type overall setting
    mood genre color colour indoor outdoor activity happening animal weather landscape style gist
    vibe"""
)
_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> set[str]:
    words = set(_WORD.findall(text.lower()))
    # Plain plurals: "totals", "tables", "numbers".
    return words | {w[:-1] for w in words if len(w) > 3 and w.endswith("s")}


def _schema_text(schema: Any) -> str:
    """Property names and descriptions of a JSON schema, as words (invoice_total -> invoice total)."""
    parts: list[str] = []
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "properties" and isinstance(value, dict):
                parts.extend(name.replace("_", " ") for name in value)
            if key in ("description", "title") and isinstance(value, str):
                parts.append(value)
            parts.append(_schema_text(value))
    elif isinstance(schema, list):
        parts.extend(_schema_text(v) for v in schema)
    return " ".join(p for p in parts if p)


def prompt_level(prompt: str) -> Level | None:
    """high for fine text, low for coarse questions, None when the prompt says neither."""
    words = _words(prompt)
    if words & FINE_WORDS:
        return "high"
    if words & COARSE_WORDS:
        return "low"
    return None


def auto_level(prompts: list[str], schema: dict[str, Any] | None = None) -> Level:
    """The ``auto`` rule: high if any prompt (or the schema) needs fine text, low if every one is
    coarse, medium otherwise. A page is encoded once for all of a job's prompts, so the most
    demanding prompt decides."""
    texts = list(prompts) + ([_schema_text(schema)] if schema else [])
    levels = [prompt_level(t) for t in texts if t.strip()]
    if "high" in levels:
        return "high"
    if levels and all(level == "low" for level in levels):
        return "low"
    return "medium"


class VisualBudget(BaseModel):
    """Part of JobSpec (``budget``). Bounds change the pixels the tower sees: they are in the cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    detail: Detail | None = Field(
        None, description="low/medium/high cap tokens per image at 256/640/1280; auto picks from prompts."
    )
    min_pixels: int | None = Field(None, ge=1, le=1 << 30, description="Processor's shortest_edge (pixels).")
    max_pixels: int | None = Field(None, ge=1, le=1 << 30, description="Processor's longest_edge (pixels).")
    max_tokens_per_frame: int | None = Field(
        None, ge=1, le=1 << 20, description="Cap on the visual tokens of every page, image or frame."
    )
    max_tokens_per_video: int | None = Field(
        None, ge=1, le=1 << 30, description="Cap on a video's frames together: its frames get smaller."
    )
    skip_redundant_frames: bool = Field(
        True, description="Video: skip frames that nearly repeat the last kept frame."
    )
    redundancy_threshold: float = Field(
        DEFAULT_REDUNDANCY_THRESHOLD,
        ge=0,
        le=255,
        description="Mean RGB difference (0-255) of 32x32 thumbnails.",
    )
    prune_keep: float = Field(
        1.0, gt=0, le=1, description="transformers engine: share of each image's visual tokens kept."
    )
    merge_keep: float = Field(
        1.0,
        gt=0,
        le=1,
        description="transformers engine: share of each image's visual tokens left after merging "
        "similar neighbours (before pruning).",
    )
    drop_static: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Windows, transformers engine: drop a frame's visual tokens that changed by less "
        "than this (relative L2) since the window last showed their position; 0 = off.",
    )

    @model_validator(mode="after")
    def _ordered_bounds(self) -> VisualBudget:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must not be above max_pixels")
        return self


@dataclass(frozen=True)
class PixelBounds:
    """The processor's resize bounds for one image (Qwen2-VL: shortest_edge / longest_edge)."""

    min_pixels: int
    max_pixels: int

    @classmethod
    def of(cls, min_pixels: int | None, max_pixels: int | None) -> PixelBounds | None:
        """From two nullable columns: None (the model's own bounds) when either is missing."""
        if min_pixels is None or max_pixels is None:
            return None
        return cls(int(min_pixels), int(max_pixels))

    def as_size(self) -> dict[str, int]:
        return {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}


@dataclass(frozen=True)
class TokenGeometry:
    """What budgets need to know of a model: pixels per visual token and its processor's bounds."""

    token_pixels: int  # Qwen2-VL: 28 * 28
    default: PixelBounds
    # A family whose detail presets pick its own knob rather than a token cap (LLaVA-OneVision: how
    # many AnyRes tiles), as (level, max_pixels) pairs; a level left out: DETAIL_TOKENS x token_pixels.
    detail_pixels: tuple[tuple[str, int], ...] = ()

    def detail_max_pixels(self, level: str) -> int:
        return dict(self.detail_pixels).get(level, DETAIL_TOKENS[level] * self.token_pixels)

    def normalize(self, bounds: PixelBounds | None) -> PixelBounds | None:
        """None for the model's own bounds, so equal preprocessing gives one cache key."""
        return None if bounds is None or bounds == self.default else bounds


def resolve_level(budget: VisualBudget, prompts: list[str], schema: dict[str, Any] | None) -> Level | None:
    if budget.detail == "auto":
        return auto_level(prompts, schema)
    return budget.detail


def job_bounds(
    budget: VisualBudget, prompts: list[str], schema: dict[str, Any] | None, geometry: TokenGeometry
) -> PixelBounds | None:
    """The bounds every image of the job gets (before a per-video cap); None = the model's own."""
    low, high = geometry.default.min_pixels, geometry.default.max_pixels
    level = resolve_level(budget, prompts, schema)
    if level is not None:
        high = geometry.detail_max_pixels(level)
    if budget.max_pixels is not None:
        high = budget.max_pixels
    if budget.min_pixels is not None:
        low = budget.min_pixels
    if budget.max_tokens_per_frame is not None:
        high = min(high, budget.max_tokens_per_frame * geometry.token_pixels)
    low = min(low, high)
    return geometry.normalize(PixelBounds(low, high))


def video_cap_bounds(
    bounds: PixelBounds | None, frames: int, tokens_per_frame: int, cap: int | None, geometry: TokenGeometry
) -> PixelBounds | None:
    """Bounds for a video's frames so that ``frames`` x tokens stays within ``cap``.

    Unchanged when the frames fit. Otherwise max_pixels becomes (cap // frames) tokens' worth
    (at least one token), which the resize rule never exceeds except for a side already at its
    28-px floor (aspect ratios near the 200:1 limit).
    """
    if cap is None or frames <= 0 or frames * tokens_per_frame <= cap:
        return bounds
    current = bounds or geometry.default
    per_frame = max(1, cap // frames)
    high = min(current.max_pixels, per_frame * geometry.token_pixels)
    return geometry.normalize(PixelBounds(min(current.min_pixels, high), high))
