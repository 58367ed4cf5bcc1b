"""Windows: the consecutive units of a source that one prompt sees together (``--window``).

``N[:S]``  N pages or sampled frames a prompt, a window starting every S units (S = N: no overlap);
``Ts[:Ss]`` (videos) the frames sampled in each T-second span, a span starting every S seconds;
``all``     the whole source in one prompt.

Windows start at the first unit and go on until one reaches the source's end, so every unit is
in at least one window (a stride longer than the window is refused: it would leave units out).
Which windows a source has is a pure function of its units (their number, their timestamps), so
both drivers, a resumed job and the results all derive the same windows and nothing about them
is stored but the answers (keyed by each window's first unit). While a source is still being
split, only the windows that cannot change any more are known (`windows_of(..., complete=False)`):
the rest wait for its last unit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Bounds: a window of more than this many units is `all` in all but name, and a prompt of
# 10,000 images fits no model's context anyway (ingest caps a video at 10,000 frames).
MAX_WINDOW_UNITS = 10_000
MAX_WINDOW_SECONDS = 24 * 3600.0

_COUNT = re.compile(r"^(\d+)(?::(\d+))?$")
_SECONDS = re.compile(r"^(\d+(?:\.\d+)?)s(?::(\d+(?:\.\d+)?)s)?$")
WINDOW_SYNTAX = "N[:S] (units), Ts[:Ss] (seconds of video, e.g. 10s:5s) or all"


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """A parsed ``--window``: by count (`size`, `stride`), by time (`seconds`, `stride_seconds`),
    or the whole source (neither)."""

    size: int | None = None
    stride: int | None = None
    seconds: float | None = None
    stride_seconds: float | None = None

    @property
    def by_time(self) -> bool:
        return self.seconds is not None

    @property
    def whole(self) -> bool:
        return self.size is None and self.seconds is None

    def windows(self, timestamps: Sequence[float | None], complete: bool = True) -> list[tuple[int, int]]:
        """`windows_of` this plan (what storage.windows asks of a job's plan)."""
        return windows_of(self, timestamps, complete=complete)


def parse_window(text: str) -> WindowPlan:
    """``--window``'s value as a plan; a ValueError says what is wrong with it."""
    value = text.strip().lower()
    if value == "all":
        return WindowPlan()
    if match := _COUNT.match(value):
        size = int(match.group(1))
        stride = int(match.group(2)) if match.group(2) is not None else size
        if not 1 <= size <= MAX_WINDOW_UNITS:
            raise ValueError(f"a window is 1 to {MAX_WINDOW_UNITS:,} units, not {size}")
        if not 1 <= stride <= size:
            raise ValueError(f"the stride {stride} must be 1 to {size}, the window's units (none left out)")
        return WindowPlan(size=size, stride=stride)
    if match := _SECONDS.match(value):
        seconds = float(match.group(1))
        stride = float(match.group(2)) if match.group(2) is not None else seconds
        if not 0 < seconds <= MAX_WINDOW_SECONDS:
            raise ValueError(f"a time window is 0 to {MAX_WINDOW_SECONDS:g} s long, not {seconds:g} s")
        if not 0 < stride <= seconds:
            raise ValueError(
                f"the stride {stride:g}s must be over 0 and at most the window's {seconds:g}s (none left out)"
            )
        return WindowPlan(seconds=seconds, stride_seconds=stride)
    raise ValueError(f"{text!r} is not a window: use {WINDOW_SYNTAX}")


def describe(plan: WindowPlan) -> str:
    """The window in words, for `status`: 'windows of 3 pages or frames, one every 2'."""
    if plan.whole:
        return "one window per source (all its pages or frames)"
    if plan.by_time:
        every = f", one every {plan.stride_seconds:g} s" if plan.stride_seconds != plan.seconds else ""
        return f"windows of {plan.seconds:g} s of video{every}"
    every = f", one every {plan.stride}" if plan.stride != plan.size else ""
    return f"windows of {plan.size} pages or frames{every}"


def windows_of(
    plan: WindowPlan, timestamps: Sequence[float | None], *, complete: bool = True
) -> list[tuple[int, int]]:
    """The windows of a source whose units (by index, from 0) have these timestamps, as
    (first, last) unit indexes, inclusive. `complete=False`: the source is still being split
    (`timestamps` are its units so far): only the windows no later unit can change."""
    n = len(timestamps)
    if n == 0:
        return []
    if plan.whole:
        return [(0, n - 1)] if complete else []
    if plan.by_time:
        return _time_windows(plan, timestamps, complete)
    size, stride = plan.size or 1, plan.stride or 1
    windows: list[tuple[int, int]] = []
    for start in range(0, n, stride):
        last = start + size - 1
        if last >= n - 1:
            if last == n - 1 or complete:  # a window cut short by the end is known at the end only
                windows.append((start, n - 1))
            break
        windows.append((start, last))
    return windows


def _time_windows(
    plan: WindowPlan, timestamps: Sequence[float | None], complete: bool
) -> list[tuple[int, int]]:
    """Spans [k*S, k*S + T) from 0 s, until one holds the last frame; a span with no frame is none.
    A frame without a timestamp (none are, for a video: ingest records each) counts as 0 s."""
    times = [t or 0.0 for t in timestamps]
    seconds, stride = plan.seconds or 1.0, plan.stride_seconds or 1.0
    end = times[-1]
    windows: list[tuple[int, int]] = []
    first = 0
    for k in range(math.floor(end / stride) + 1):
        start = k * stride
        stop = start + seconds
        if not complete and stop > end:
            break  # a later frame may still fall in this span
        while first < len(times) and times[first] < start:
            first += 1
        last = first
        while last < len(times) and times[last] < stop:
            last += 1
        if last > first:
            windows.append((first, last - 1))
        if stop > end:
            break
    return windows
