"""A source's unit rows under its job's visual-token budget.

Every page or frame the splitter stored becomes one row here, with the job's resize bounds
(detail preset, explicit pixels, per-frame cap) and its token count under them (from the
model's own resize rule, so batches can be packed before any GPU work and ingest needs no
weights), plus its count at the model's own bounds
(for "tokens saved"); video frames that repeat the last kept frame become ``skipped`` rows; and
a video whose kept frames together exceed the per-video cap gets smaller bounds for all of them.
The images are stored at full size either way: the bounds act when the processor resizes them
for the tower, so lowering them after the fact costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ingest.budget import PixelBounds, TokenGeometry, VisualBudget, job_bounds, video_cap_bounds
from ingest.frames import RedundantFrames, Skip
from ingest.isolation import StoredUnit
from ingest.units import UnitFailure
from storage.rows import UnitRow

MAX_TOKENS_SETTING = "VISBATCH_LIMIT_MAX_VISUAL_TOKENS"


class TokenRule(Protocol):
    """What of a model adapter the budget needs (no weights)."""

    @property
    def token_geometry(self) -> TokenGeometry: ...

    def count_visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int: ...


@dataclass(frozen=True)
class SourceBudget:
    budget: VisualBudget
    bounds: PixelBounds | None  # the job's bounds; None: the model's own
    geometry: TokenGeometry
    count: Callable[[int, int, PixelBounds | None], int]

    @classmethod
    def for_job(cls, spec: Any, rule: TokenRule) -> SourceBudget:
        """From a JobSpec (prompts, schema, budget) and the model's token rule."""
        geometry = rule.token_geometry
        bounds = job_bounds(spec.budget, list(spec.prompts), spec.json_schema, geometry)
        return cls(spec.budget, bounds, geometry, rule.count_visual_tokens)

    def rows(
        self, items: Iterable[StoredUnit | UnitFailure], kind: str, max_tokens: int
    ) -> Iterator[UnitRow]:
        """The rows of one source, in order (the per-video cap holds a video's rows until its end)."""
        frames = (
            RedundantFrames(self.budget.redundancy_threshold)
            if kind == "video" and self.budget.skip_redundant_frames
            else None
        )

        def each() -> Iterator[tuple[StoredUnit | UnitFailure, Skip | None]]:
            for item in items:
                skip = None
                if frames is not None and isinstance(item, StoredUnit):
                    skip = frames.check(item.index, item.signature, item.timestamp)
                yield item, skip

        if kind == "video" and self.budget.max_tokens_per_video is not None:
            yield from self._capped(list(each()), max_tokens)
        else:
            for item, skip in each():
                yield self._row(item, self.bounds, max_tokens, skip)

    def _row(
        self, item: StoredUnit | UnitFailure, bounds: PixelBounds | None, max_tokens: int, skip: Skip | None
    ) -> UnitRow:
        """The one place a unit's row is built: a failure, a skipped frame, or a page or frame with
        its token count under `bounds` (an error when the model's rule refuses it or it is over
        `max_tokens`: a row with an error, not an exception, so the source's other units go on)."""
        if isinstance(item, UnitFailure):
            return UnitRow(
                index=item.index, width=None, height=None, image_key=None, visual_tokens=None,
                timestamp=item.timestamp, error=item.message,
            )  # fmt: skip
        full = self._count_or_none(item, None)
        if skip is not None:
            return UnitRow(
                index=item.index, width=item.width, height=item.height, image_key=item.image_key,
                visual_tokens=None, timestamp=item.timestamp, text=item.text, full_tokens=full,
                skip_reason=skip.reason, duplicate_of=skip.duplicate_of,
            )  # fmt: skip
        error, tokens = None, None
        try:
            tokens = self.count(item.width, item.height, bounds)
        except ValueError as exc:  # e.g. an aspect ratio the model's resize rule refuses
            error = f"cannot be encoded: {exc}"
        if tokens is not None and tokens > max_tokens:
            error = f"{tokens} visual tokens, over the limit of {max_tokens} ({MAX_TOKENS_SETTING})"
        if error is not None:
            return UnitRow(
                index=item.index, width=item.width, height=item.height, image_key=None,
                visual_tokens=None, timestamp=item.timestamp, text=item.text, error=error,
            )  # fmt: skip
        return UnitRow(
            index=item.index, width=item.width, height=item.height, image_key=item.image_key,
            visual_tokens=tokens, timestamp=item.timestamp, text=item.text,
            min_pixels=bounds.min_pixels if bounds else None,
            max_pixels=bounds.max_pixels if bounds else None,
            full_tokens=full,
        )  # fmt: skip

    def _count_or_none(self, item: StoredUnit, bounds: PixelBounds | None) -> int | None:
        try:
            return self.count(item.width, item.height, bounds)
        except ValueError:
            return None

    def _capped(
        self, items: list[tuple[StoredUnit | UnitFailure, Skip | None]], max_tokens: int
    ) -> list[UnitRow]:
        """A whole video's rows; when its kept frames together exceed the per-video cap, every
        kept frame is counted again under the smaller bounds the cap gives."""
        rows = [self._row(item, self.bounds, max_tokens, skip) for item, skip in items]
        kept = [r for r in rows if r.visual_tokens is not None and r.error is None and r.skip_reason is None]
        if not kept:
            return rows
        per_frame = max(r.visual_tokens or 0 for r in kept)
        cap = self.budget.max_tokens_per_video
        bounds = video_cap_bounds(self.bounds, len(kept), per_frame, cap, self.geometry)
        if bounds == self.bounds:
            return rows
        kept_indexes = {row.index for row in kept}
        return [
            self._row(item, bounds, max_tokens, skip) if row.index in kept_indexes else row
            for (item, skip), row in zip(items, rows, strict=True)
        ]
