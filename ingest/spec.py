"""What a job asks for: prompts, an optional JSON schema, sampling and ingest options.

The spec is stored as JSON on the job row, so every field here must be JSON-serializable,
and a worker in the fleet rebuilds exactly the same spec from the row.

One validation for every door: ``JobSpec`` itself checks everything, the JSON schema included
(bounds, meta-schema, grammar compile: ``ingest.schema``), so the CLI, the drop folder and Python
callers cannot disagree. ``spec_from_json`` / ``spec_from_fields`` / ``schema_from_json`` turn any
failure into a ``SpecError`` whose message is the same wherever the spec came from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ingest.budget import VisualBudget
from ingest.schema import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, JSONTooDeep, check_schema, loads_json
from ingest.windows import WINDOW_SYNTAX, WindowPlan, parse_window

__all__ = [
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "CACHE_POLICIES",
    "MAX_SPEC_BYTES",
    "CachePolicy",
    "IngestOptions",
    "JobSpec",
    "Sampling",
    "SpecError",
    "describe_spec_error",
    "schema_from_json",
    "spec_from_fields",
    "spec_from_json",
]

# One item of a page range ("3", "1-3", "5-"), 1-based; the PDF splitter checks it against the
# page count, the spec only its syntax (so a typo is refused before a job starts).
PAGE_RANGE_ITEM = re.compile(r"^\s*(\d+)\s*(?:(-)\s*(\d*)\s*)?$")

# What the token cache keeps of a job's pages (docs/scale.md, "The token cache at scale"):
#   cold  every tier configured (fleet: Redis + S3; embedded: the folder): entries outlive the job,
#         a rerun or another job over the same pages skips the vision tower (the default);
#   hot   the hot tier alone (fleet: Redis, bounded by its maxmemory and the TTL); S3 never touched;
#   none  the hot tier alone with a short TTL, each entry deleted once its unit's answers are stored.
CachePolicy = Literal["cold", "hot", "none"]
CACHE_POLICIES: tuple[str, ...] = ("cold", "hot", "none")

# Turns after a prompt (`--then`): a conversation of 1 + 16 questions is long for any VLM.
MAX_FOLLOW_UPS = 16

# A spec file holds prompts (64 x 32,000 characters at most) and a 64 KiB schema.
MAX_SPEC_BYTES = 4 * 1024 * 1024


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

    @field_validator("pages")
    @classmethod
    def _page_ranges(cls, pages: str | None) -> str | None:
        if pages is None:
            return pages
        if not pages.strip():
            raise ValueError("empty page range")
        for item in pages.split(","):
            match = PAGE_RANGE_ITEM.match(item)
            if match is None:
                raise ValueError(f"bad page range {item.strip()!r} (expected e.g. '1-3,7')")
            if int(match.group(1)) < 1:
                raise ValueError(f"bad page range {item.strip()!r}: pages are numbered from 1")
            if match.group(3) and int(match.group(3)) < int(match.group(1)):
                raise ValueError(f"bad page range {item.strip()!r}: the end is before the start")
        return pages

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
    seed: int = Field(
        0, ge=0, le=2**32 - 1, description="Seed for sampling; results are reproducible per job."
    )


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: list[str] = Field(min_length=1, max_length=64)
    json_schema: dict[str, Any] | None = Field(None, description="Constrain every output to this schema.")
    model: str | None = Field(None, description="Overrides the settings' model for this job.")
    sampling: Sampling = Field(default_factory=Sampling)
    ingest: IngestOptions = Field(default_factory=IngestOptions)
    # Detail presets, token caps, redundant-frame skipping, pruning (see ingest.budget).
    budget: VisualBudget = Field(default_factory=VisualBudget)
    # Not part of any cache key: it says where entries are kept and for how long, not what they hold.
    cache: CachePolicy = Field("cold", description="Token cache policy: cold, hot or none.")
    # Several consecutive units in one prompt (ingest.windows); None: each unit is asked alone.
    window: str | None = Field(None, description=f"Units one prompt sees: {WINDOW_SYNTAX}.")
    # Follow-up turns per prompt (`--then`): then[i] continues the conversation of prompts[i], each
    # turn seeing the same images, the earlier turns and their answers. Empty: no follow-ups.
    then: list[list[str]] = Field(default_factory=list, description="Follow-up turns, one list per prompt.")
    # Once a source's answers are all in, one text-only request over them (`--summarize`): one
    # row per source (scope `source`).
    summarize: str | None = Field(None, description="A question asked of each source's answers.")

    @field_validator("prompts")
    @classmethod
    def _non_empty_prompts(cls, prompts: list[str]) -> list[str]:
        for prompt in prompts:
            if not prompt.strip():
                raise ValueError("a prompt must not be empty")
            if len(prompt) > 32_000:
                raise ValueError("a prompt must be under 32,000 characters")
        return prompts

    @field_validator("window")
    @classmethod
    def _window(cls, window: str | None) -> str | None:
        if window is None:
            return None
        parse_window(window)  # a ValueError names what is wrong
        return window.strip().lower()

    def window_plan(self) -> WindowPlan | None:
        return parse_window(self.window) if self.window is not None else None

    @field_validator("then")
    @classmethod
    def _turns_per_prompt(cls, then: list[list[str]], info: ValidationInfo) -> list[list[str]]:
        prompts = len(info.data.get("prompts") or [])
        if then and len(then) != prompts:
            raise ValueError(f"one list of follow-ups per prompt ({prompts}), not {len(then)}")
        for turns in then:
            if len(turns) > MAX_FOLLOW_UPS:
                raise ValueError(f"at most {MAX_FOLLOW_UPS} follow-up turns per prompt, not {len(turns)}")
            for turn in turns:
                if not turn.strip():
                    raise ValueError("a follow-up turn must not be empty")
                if len(turn) > 32_000:
                    raise ValueError("a follow-up turn must be under 32,000 characters")
        return then

    @field_validator("summarize")
    @classmethod
    def _summary_prompt(cls, summarize: str | None) -> str | None:
        if summarize is not None and not summarize.strip():
            raise ValueError("the summary's prompt must not be empty")
        if summarize is not None and len(summarize) > 32_000:
            raise ValueError("the summary's prompt must be under 32,000 characters")
        return summarize

    def turns(self, prompt_index: int) -> list[str]:
        """The questions of one prompt's conversation: the prompt, then its follow-ups."""
        return [self.prompts[prompt_index], *(self.then[prompt_index] if self.then else [])]

    def questions(self) -> list[tuple[int, int]]:
        """Every (prompt index, turn) a unit or window is asked, in order."""
        return [(p, t) for p in range(len(self.prompts)) for t in range(len(self.turns(p)))]

    @field_validator("json_schema")
    @classmethod
    def _usable_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            check_schema(schema)  # a SchemaError is a ValueError: pydantic reports it on this field
        return schema


class SpecError(ValueError):
    """A job spec that cannot be used; the message is for people and names the field at fault."""


def describe_spec_error(exc: ValidationError) -> str:
    """One line per problem, ``field: reason``, without pydantic's URLs and input dumps (a schema
    can be 64 KiB: repeating it in a message helps nobody)."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"]) or "(spec)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (check its spelling)"
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


def spec_from_fields(fields: Mapping[str, Any], base: JobSpec | None = None) -> JobSpec:
    """A spec from its fields (a parsed spec file); ``base``'s fields fill in the ones not given."""
    merged = {**(base.model_dump(mode="json") if base is not None else {}), **fields}
    try:
        return JobSpec.model_validate(merged)
    except ValidationError as exc:
        raise SpecError(f"invalid job spec: {describe_spec_error(exc)}") from None


def spec_from_json(raw: str | bytes, base: JobSpec | None = None, *, what: str = "the spec") -> JobSpec:
    """A spec from a JSON document (a ``--spec`` file, a drop folder's ``_spec.json``)."""
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"invalid job spec: {what} is over {MAX_SPEC_BYTES} bytes")
    try:
        fields = loads_json(raw, what)
    except JSONTooDeep:  # only a schema may nest at all, and not this deep
        raise SpecError(
            f"invalid job spec: nested deeper than {MAX_SCHEMA_DEPTH} levels (the limit of a JSON schema)"
        ) from None
    except ValueError as exc:
        raise SpecError(f"invalid job spec: {exc}") from None
    if not isinstance(fields, dict):
        raise SpecError(f"invalid job spec: {what} must be a JSON object of fields (prompts, json_schema...)")
    return spec_from_fields(fields, base)


def schema_from_json(raw: str | bytes, *, what: str = "the JSON schema") -> dict[str, Any]:
    """A JSON schema from a file's text (``--schema``), checked like every spec's schema."""
    if len(raw) > MAX_SPEC_BYTES:  # checked again, exactly, by check_schema: this bounds the parse
        raise SpecError(f"invalid job spec: json_schema: the JSON schema is over {MAX_SCHEMA_BYTES} bytes")
    try:
        schema = loads_json(raw, what)
        check_schema(schema)
    except JSONTooDeep:  # the same words as a schema just over the limit: it is the same problem
        raise SpecError(
            f"invalid job spec: json_schema: the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
        ) from None
    except ValueError as exc:
        raise SpecError(f"invalid job spec: json_schema: {exc}") from None
    return schema
