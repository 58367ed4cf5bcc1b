"""Redundant video frames: a cheap perceptual signature per frame, and the skip rule.

A frame's signature is its 32x32 RGB thumbnail (3 KiB, sent as base64 by the splitting
process, which has the pixels). A frame whose mean absolute difference from the last KEPT
frame (over pixels and channels, in levels of 0-255) is under the threshold is skipped: it
is recorded as a unit with status ``skipped``, the reason and the index of the frame it
duplicates, and is never encoded nor asked anything. Comparing with the last kept frame (not
the previous one) means a slow drift still produces a new frame once it adds up. Colour, not
grey: a red object moving over a background of the same brightness changes a grey thumbnail
by under 2 levels, the RGB one by 5-11.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
from PIL import Image

THUMB_SIDE = 32
THUMB_BYTES = THUMB_SIDE * THUMB_SIDE * 3


def frame_signature(image: Image.Image) -> str:
    """The 32x32 RGB thumbnail (box filter: an average over each cell) as base64."""
    thumb = image.convert("RGB").resize((THUMB_SIDE, THUMB_SIDE), Image.Resampling.BOX)
    return base64.b64encode(thumb.tobytes()).decode("ascii")


def _pixels(signature: str) -> np.ndarray:
    data = np.frombuffer(base64.b64decode(signature), dtype=np.uint8)
    if data.size != THUMB_BYTES:
        raise ValueError(f"a frame signature has {THUMB_BYTES} bytes, got {data.size}")
    return data.astype(np.float32)


def signature_distance(a: str, b: str) -> float:
    """Mean absolute difference of two signatures over pixels and channels (0 = identical, 255 = opposite)."""
    return float(np.abs(_pixels(a) - _pixels(b)).mean())


@dataclass(frozen=True)
class Skip:
    duplicate_of: int  # index of the kept frame this one repeats
    reason: str


class RedundantFrames:
    """Walks one video's frames in order; says which to skip. One instance per source."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._kept: tuple[int, str] | None = None

    def check(self, index: int, signature: str | None, timestamp: float | None = None) -> Skip | None:
        """None: keep the frame (it becomes the new reference). A Skip: leave it out, with why."""
        if signature is None:
            return None  # no signature (an older splitter): keep everything
        if self._kept is not None:
            kept_index, kept_signature = self._kept
            distance = signature_distance(kept_signature, signature)
            if distance < self.threshold:
                return Skip(
                    duplicate_of=kept_index,
                    reason=(
                        f"near-duplicate of frame {kept_index} (mean difference {distance:.2f} "
                        f"< {self.threshold:g} on 32x32 RGB thumbnails)"
                    ),
                )
        self._kept = (index, signature)
        return None
