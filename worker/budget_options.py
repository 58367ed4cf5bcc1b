"""The visual-token budget's command-line options, shared by `run`, `submit` and `plan`."""

from __future__ import annotations

from typing import Annotated

import typer

from ingest.budget import DEFAULT_REDUNDANCY_THRESHOLD, VisualBudget

Detail = Annotated[
    str | None,
    typer.Option(
        metavar="LEVEL",
        help="Visual detail: low, medium, high (at most 256/640/1280 tokens per image) or auto "
        "(from the prompts: fine text -> high, coarse questions -> low, else medium). "
        "Default: the model's own resize bounds.",
    ),
]
MinPixels = Annotated[
    int | None, typer.Option(metavar="N", help="Processor's min pixels per image (overrides --detail).")
]
MaxPixels = Annotated[
    int | None, typer.Option(metavar="N", help="Processor's max pixels per image (overrides --detail).")
]
MaxTokensPerFrame = Annotated[
    int | None, typer.Option(metavar="N", help="At most N visual tokens per page, image or frame.")
]
MaxTokensPerVideo = Annotated[
    int | None, typer.Option(metavar="N", help="At most N visual tokens per video (its frames get smaller).")
]
SkipFrames = Annotated[
    bool,
    typer.Option(
        "--skip-redundant-frames/--keep-all-frames",
        help="Video: skip frames that nearly repeat the last kept one (recorded as skipped).",
    ),
]
RedundancyThreshold = Annotated[
    float,
    typer.Option(
        metavar="D", help="Skip a frame below this mean difference (0-255) of 32x32 RGB thumbnails."
    ),
]
PruneKeep = Annotated[
    float,
    typer.Option(
        metavar="F", help="transformers engine: keep this share of each image's visual tokens (1 = off)."
    ),
]
MergeKeep = Annotated[
    float,
    typer.Option(
        metavar="F",
        help="transformers engine: merge the most similar neighbouring visual tokens (averaging) until "
        "this share of each image's tokens is left (1 = off); before --prune-keep.",
    ),
]


def visual_budget(
    detail: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    max_tokens_per_frame: int | None = None,
    max_tokens_per_video: int | None = None,
    skip_redundant_frames: bool = True,
    redundancy_threshold: float = DEFAULT_REDUNDANCY_THRESHOLD,
    prune_keep: float = 1.0,
    merge_keep: float = 1.0,
) -> VisualBudget:
    """Raises ValueError (pydantic's) with a readable message for a bad value."""
    return VisualBudget(
        detail=detail,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        max_tokens_per_frame=max_tokens_per_frame,
        max_tokens_per_video=max_tokens_per_video,
        skip_redundant_frames=skip_redundant_frames,
        redundancy_threshold=redundancy_threshold,
        prune_keep=prune_keep,
        merge_keep=merge_keep,
    )
