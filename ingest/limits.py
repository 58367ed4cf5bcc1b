"""Limits on what one source may cost, so that a hostile or broken file fails alone.

Each has a safe default and a setting (VISBATCH_LIMIT_*); going over one is a clear error on
that source or unit, never a crashed or hung worker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_source_bytes: int = 2 * 1024**3  # a file larger than this is refused before it is read
    max_pdf_pages: int = 5_000  # pages selected from one PDF (use --pages for a range)
    max_video_seconds: float = 6 * 3600.0  # duration of one video
    max_image_pixels: int = 200_000_000  # decoded pixels of one image (decompression bombs)
    max_render_pixels: int = 50_000_000  # pixels of one page render (huge MediaBoxes are scaled down)
    max_visual_tokens: int = 16_384  # visual tokens of one page or frame
    unit_timeout_s: float = 60.0  # seconds one page render or frame decode may take
    memory_bytes: int = 8 * 1024**3  # address space of the process that splits sources

    @classmethod
    def from_settings(cls, settings: object) -> Limits:
        """Fields of `settings` named limit_<field> override the defaults."""
        values = {
            name: getattr(settings, f"limit_{name}")
            for name in cls.__dataclass_fields__
            if getattr(settings, f"limit_{name}", None) is not None
        }
        return cls(**values)
