"""A source's unit rows under its job's visual-token budget.

Wraps the ingest stage's rows: every unit gets the job's resize bounds (detail preset, explicit
pixels, per-frame cap) and its token count under them, plus its count at the model's own bounds
(for "tokens saved"); video frames that repeat the last kept frame become ``skipped`` rows; and
a video whose kept frames together exceed the per-video cap gets smaller bounds for all of them.
The images are stored at full size either way: the bounds act when the processor resizes them
for the tower, so lowering them after the fact costs nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ingest.budget import PixelBounds, TokenGeometry, VisualBudget, job_bounds, video_cap_bounds
from ingest.frames import RedundantFrames, Skip
from ingest.isolation import StoredUnit
from ingest.stage import unit_rows
from ingest.units import UnitFailure
from storage.rows import UnitRow


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

    def count_tokens(self, width: int, height: int) -> int:
        return self.count(width, height, self.bounds)

    def rows(
        self, items: Iterable[StoredUnit | UnitFailure], kind: str, max_tokens: int
    ) -> Iterator[UnitRow]:
        """The rows of one source, in order (the per-video cap holds a video's rows until its end)."""
        frames = (
            RedundantFrames(self.budget.redundancy_threshold)
            if kind == "video" and self.budget.skip_redundant_frames
            else None
        )

        def each() -> Iterator[UnitRow]:
            for item in items:
                if frames is not None and isinstance(item, StoredUnit):
                    skip = frames.check(item.index, getattr(item, "signature", None), item.timestamp)
                    if skip is not None:
                        yield self._skipped(item, skip)
                        continue
                for row in unit_rows([item], self.count_tokens, max_tokens):
                    yield self._annotate(row, self.bounds)

        if kind == "video" and self.budget.max_tokens_per_video is not None:
            yield from self._capped(list(each()))
        else:
            yield from each()

    def _annotate(self, row: UnitRow, bounds: PixelBounds | None) -> UnitRow:
        if row.error or row.visual_tokens is None or row.width is None or row.height is None:
            return row
        return dataclasses.replace(
            row,
            min_pixels=bounds.min_pixels if bounds else None,
            max_pixels=bounds.max_pixels if bounds else None,
            full_tokens=self.count(row.width, row.height, None),
        )

    def _skipped(self, item: StoredUnit, skip: Skip) -> UnitRow:
        try:
            full: int | None = self.count(item.width, item.height, None)
        except ValueError:
            full = None
        return UnitRow(
            index=item.index, width=item.width, height=item.height, image_key=item.image_key,
            visual_tokens=None, timestamp=item.timestamp, text=item.text, full_tokens=full,
            skip_reason=skip.reason, duplicate_of=skip.duplicate_of,
        )  # fmt: skip

    def _capped(self, rows: list[UnitRow]) -> list[UnitRow]:
        kept = [r for r in rows if r.visual_tokens is not None and r.error is None and r.skip_reason is None]
        if not kept:
            return rows
        per_frame = max(r.visual_tokens or 0 for r in kept)
        cap = self.budget.max_tokens_per_video
        bounds = video_cap_bounds(self.bounds, len(kept), per_frame, cap, self.geometry)
        if bounds == self.bounds:
            return rows
        kept_indexes = {r.index for r in kept}
        out = []
        for row in rows:
            if row.index in kept_indexes:
                tokens = self.count(row.width or 0, row.height or 0, bounds)
                row = self._annotate(dataclasses.replace(row, visual_tokens=tokens), bounds)
            out.append(row)
        return out
