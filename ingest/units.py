"""What splitting a source yields: upright RGB images, or a failure for one page or frame."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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


@dataclass(frozen=True)
class UnitSelection:
    """Which of a PDF's pages to produce: positions [first, first + limit) of its selected pages,
    minus the page indexes in `skip` (already stored: a resumed job renders no page twice).

    A fleet ingest task takes one range and hands the rest on, so no task outlives the broker's
    redelivery timeout. Videos are decoded whole (a frame's redundancy check needs the frames
    before it): the selection does not apply to them.
    """

    first: int = 0
    limit: int | None = None
    skip: frozenset[int] = field(default_factory=frozenset)

    def pick(self, indexes: Sequence[int]) -> list[int]:
        end = None if self.limit is None else self.first + self.limit
        return [i for i in indexes[self.first : end] if i not in self.skip]

    def as_json(self) -> dict[str, Any]:
        return {"first": self.first, "limit": self.limit, "skip": sorted(self.skip)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> UnitSelection:
        if not data:
            return cls()
        return cls(int(data.get("first", 0)), data.get("limit"), frozenset(data.get("skip") or ()))
