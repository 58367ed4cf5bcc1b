"""What splitting a source yields: upright RGB images, or a failure for one page or frame."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from PIL import Image

SourceKind = Literal["pdf", "video", "image"]


class SourceError(Exception):
    """The whole source cannot be read (not a PDF, encrypted, no video stream ...).

    The message is shown to the user as is, on that source; the rest of the job goes on.
    """


@dataclass(frozen=True)
class RenderedImage:
    """One page or frame, ready to be stored and encoded."""

    index: int  # 0-based page number, or 0-based ordinal of the sampled frame
    image: Image.Image  # RGB, upright (page rotation, EXIF and stream rotation applied)
    timestamp: float | None = None  # seconds from the start of a video
    text: str | None = None  # the PDF page's text layer


@dataclass(frozen=True)
class UnitFailure:
    """One page or frame that could not be produced; the other units of the source go on."""

    index: int
    message: str
    timestamp: float | None = None
