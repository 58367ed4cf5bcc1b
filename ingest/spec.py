"""What a job asks for: prompts, an optional JSON schema, sampling and ingest options.

The spec is stored as JSON on the job row, so every field here must be JSON-serializable,
and a worker in the fleet rebuilds exactly the same spec from the row.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ingest.budget import VisualBudget

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32


class IngestOptions(BaseModel):
    """How sources become images. Every field changes the pixels, so all are part of the cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    longest_side: int | None = Field(1288, ge=28, le=8192, description="PDF render: longest side in px.")
    dpi: int | None = Field(None, ge=18, le=1200, description="PDF render by DPI instead of longest side.")
    pages: str | None = Field(None, description="PDF page ranges, 1-based, e.g. '1-3,7'.")
    fps: float | None = Field(1.0, gt=0, le=60, description="Video: frames sampled per second.")
    max_frames: int = Field(64, ge=1, le=10_000, description="Video: cap on sampled frames.")
    num_frames: int | None = Field(None, ge=1, le=10_000, description="Video: N frames spread uniformly.")
    keyframes: bool = Field(
        False, description="Video: sparse samples snap to the nearest keyframe (timestamps as decoded)."
    )

    @model_validator(mode="after")
    def _one_video_mode(self) -> IngestOptions:
        if self.dpi is not None and self.longest_side is not None:
            # DPI given explicitly wins; longest side is the default only.
            object.__setattr__(self, "longest_side", None)
        return self


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(256, ge=1, le=32_768)
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, description="Seed for sampling; results are reproducible per job.")


def _depth(node: Any, level: int = 0) -> int:
    if isinstance(node, dict):
        return max((_depth(v, level + 1) for v in node.values()), default=level + 1)
    if isinstance(node, list):
        return max((_depth(v, level + 1) for v in node), default=level + 1)
    return level


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: list[str] = Field(min_length=1, max_length=64)
    json_schema: dict[str, Any] | None = Field(None, description="Constrain every output to this schema.")
    model: str | None = Field(None, description="Overrides the settings' model for this job.")
    sampling: Sampling = Field(default_factory=Sampling)
    ingest: IngestOptions = Field(default_factory=IngestOptions)
    # Detail presets, token caps, redundant-frame skipping, pruning (see ingest.budget).
    budget: VisualBudget = Field(default_factory=VisualBudget)

    @field_validator("prompts")
    @classmethod
    def _non_empty_prompts(cls, prompts: list[str]) -> list[str]:
        for prompt in prompts:
            if not prompt.strip():
                raise ValueError("a prompt must not be empty")
            if len(prompt) > 32_000:
                raise ValueError("a prompt must be under 32,000 characters")
        return prompts

    @field_validator("json_schema")
    @classmethod
    def _bounded_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
            raise ValueError(f"the JSON schema is over {MAX_SCHEMA_BYTES} bytes")
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH}")
        return schema
