"""The job options, declared once for `run`, `submit`, `plan` (and `ingest`) and the Python API.

A job option is declared here once, in its group (inputs, prompt, schema, model, ingest,
sampling, budget); a command takes the groups it needs with ``@job_options(...)`` and gets ONE
parameter, a ``JobOptions``, that builds the ``JobSpec`` (one place, one validation: the spec's
own) and names the option at fault when a value is refused. Adding a flag is one ``Opt`` line
in its group (an ingest option that is an ``IngestOptions`` field needs nothing else). The
Python API (visbatch.api) takes the same options as keyword arguments and refuses a value as the
command does (tests/test_python_api.py).

How: the decorator rewrites the command's signature (Typer reads ``inspect.signature``), putting
the groups' parameters where the command has its ``job: JobOptions`` parameter, and gathers
their values back into that one object before calling the command.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ingest.budget import DEFAULT_REDUNDANCY_THRESHOLD, VisualBudget
from ingest.spec import IngestOptions, JobSpec, Sampling
from worker.budget_options import (
    Detail,
    MaxPixels,
    MaxTokensPerFrame,
    MaxTokensPerVideo,
    MergeKeep,
    MinPixels,
    PruneKeep,
    RedundancyThreshold,
    SkipFrames,
)
from worker.errors import UserError

# The prompt used by `plan` when none is given (it only changes the prompt-token estimate).
DEFAULT_PLAN_PROMPT = "What is on this page or frame? Answer in one sentence."


@dataclass(frozen=True)
class Opt:
    """One command-line option: its Python name, its Typer annotation and default, its group."""

    name: str
    annotation: Any
    default: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _opt(metavar: str, help: str, **extra: Any) -> Any:
    return typer.Option(metavar=metavar, help=help, **extra)


# --- the groups --------------------------------------------------------------------------------

# Which files a walked folder contributes (files named on the command line are always taken).
INPUT_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "include",
        Annotated[
            list[str] | None,
            typer.Option(
                metavar="GLOB",
                help="In walked folders take only files matching GLOB (repeatable; e.g. '*.pdf'). "
                "Default: files that are PDFs, videos or images by name or content.",
                show_default=False,
            ),
        ],
    ),
    Opt(
        "exclude",
        Annotated[
            list[str] | None,
            typer.Option(
                metavar="GLOB",
                help="In walked folders skip files matching GLOB (repeatable).",
                show_default=False,
            ),
        ],
    ),  # fmt: skip
)


def prompt_option(required: bool) -> Opt:
    help_text = "A question asked of every page, frame and image (repeatable)."
    if required:
        return Opt(
            "prompt",
            Annotated[list[str], typer.Option("--prompt", "-p", metavar="TEXT", help=help_text)],
            ...,
        )
    return Opt(
        "prompt",
        Annotated[
            list[str] | None,
            typer.Option(
                "--prompt", "-p", metavar="TEXT", help=help_text + " Default: a one-sentence description."
            ),
        ],
    )


SCHEMA_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "schema",
        Annotated[
            Path | None,
            typer.Option(metavar="FILE", help="JSON schema file: every answer is JSON constrained to it."),
        ],
    ),
)

MODEL_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "model",
        Annotated[
            str | None,
            typer.Option(
                metavar="ID|DIR",
                help="Hub id or local folder. Default: $VISBATCH_MODEL, else this folder's "
                "(`visbatch model use`), else Qwen/Qwen2-VL-2B-Instruct.",
                show_default=False,
            ),
        ],
    ),
)

# How sources become images: every field of ingest.spec.IngestOptions, and nothing else.
# (One place: a new option that is an IngestOptions field is this one line; JobOptions.ingest
# passes it on by name.)
INGEST_OPTIONS: tuple[Opt, ...] = (
    Opt("longest_side", Annotated[int | None, _opt("PX", "PDF pages: longest side in pixels.")], 1288),
    Opt("dpi", Annotated[int | None, _opt("N", "PDF pages: render at N DPI instead.")]),
    Opt("pages", Annotated[str | None, _opt("RANGES", "PDF pages to take, from 1: '1-3,7'.")]),
    Opt("fps", Annotated[float | None, _opt("F", "Video: frames sampled per second (default 1.0).")]),
    Opt("num_frames", Annotated[int | None, _opt("N", "Video: N frames spread evenly (instead of --fps).")]),
    Opt(
        "max_frames",
        Annotated[int, _opt("N", "Video: at most N frames, 64 by default (spread over the whole video).")],
        64,
    ),
    Opt(
        "keyframes",
        Annotated[
            bool,
            typer.Option(
                "--keyframes",
                help="Video: take the keyframe nearest to each sample when samples are sparser than "
                "keyframes (near-flat cost on long videos; timestamps are the keyframes').",
            ),
        ],
        False,
    ),
)

SAMPLING_OPTIONS: tuple[Opt, ...] = (
    Opt("max_new_tokens", Annotated[int, _opt("N", "Tokens generated at most per answer.")], 256),
    Opt("temperature", Annotated[float, _opt("T", "Sampling temperature; 0 = greedy.")], 0.0),
    Opt("top_p", Annotated[float, _opt("P", "Nucleus sampling: the top probability mass kept.")], 1.0),
    Opt("seed", Annotated[int, _opt("N", "Sampling seed (answers are reproducible).")], 0),
)

BUDGET_OPTIONS: tuple[Opt, ...] = (
    Opt("detail", Detail),
    Opt("min_pixels", MinPixels),
    Opt("max_pixels", MaxPixels),
    Opt("max_tokens_per_frame", MaxTokensPerFrame),
    Opt("max_tokens_per_video", MaxTokensPerVideo),
    Opt("skip_redundant_frames", SkipFrames, True),
    Opt("redundancy_threshold", RedundancyThreshold, DEFAULT_REDUNDANCY_THRESHOLD),
    Opt("prune_keep", PruneKeep, 1.0),
    Opt("merge_keep", MergeKeep, 1.0),
)

# Where the job's visual tokens are kept (ingest.spec.CachePolicy; docs/scale.md).
CACHE_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "cache",
        Annotated[
            str,
            _opt(
                "POLICY",
                "Token cache: cold (Redis + S3, or the local folder: kept for reruns and other jobs), "
                "hot (Redis alone, expires), none (deleted once the page is answered).",
            ),
        ],
        "cold",
    ),
)

GROUPS: dict[str, tuple[Opt, ...]] = {
    "inputs": INPUT_OPTIONS,
    "schema": SCHEMA_OPTIONS,
    "model": MODEL_OPTIONS,
    "ingest": INGEST_OPTIONS,
    "sampling": SAMPLING_OPTIONS,
    "budget": BUDGET_OPTIONS,
    "cache": CACHE_OPTIONS,
}
# What `run`, `submit` and `plan` take: everything that goes into a job.
JOB_GROUPS = ("prompt", "inputs", "schema", "model", "ingest", "sampling", "budget", "cache")

# A spec field (pydantic's error location) -> the option that sets it, to name it in errors.
_FIELD_FLAGS = {
    "prompts": "--prompt",
    "json_schema": "--schema",
    "skip_redundant_frames": "--skip-redundant-frames/--keep-all-frames",
}


class JobOptions:
    """The values of a command's job options, and the JobSpec they make."""

    def __init__(self, values: dict[str, Any], *, python: bool = False) -> None:
        self.values = values
        self.python = python  # errors name `detail='ultra'` (Python callers), else `--detail ultra`

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    @property
    def model(self) -> str | None:
        return self.values.get("model")

    @property
    def prompts(self) -> list[str]:
        return list(self.values.get("prompt") or [])

    @property
    def include(self) -> list[str]:
        return list(self.values.get("include") or [])

    @property
    def exclude(self) -> list[str]:
        return list(self.values.get("exclude") or [])

    def ingest(self) -> IngestOptions:
        # Every ingest option that is a field of IngestOptions goes in as given (None: its
        # default), so a new option needs no line here. --dpi wins over the default longest side.
        given = {
            opt.name: self.values[opt.name]
            for opt in INGEST_OPTIONS
            if opt.name in IngestOptions.model_fields and self.values.get(opt.name) is not None
        }
        if given.get("dpi") is not None:
            given["longest_side"] = None
        return self._checked(lambda: IngestOptions(**given))

    def sampling(self) -> Sampling:
        fields = {opt.name: self.values[opt.name] for opt in SAMPLING_OPTIONS if opt.name in self.values}
        return self._checked(lambda: Sampling(**fields))

    def budget(self) -> VisualBudget:
        fields = {opt.name: self.values[opt.name] for opt in BUDGET_OPTIONS if opt.name in self.values}
        return self._checked(lambda: VisualBudget(**fields))

    def json_schema(self) -> dict[str, Any] | None:
        from ingest.spec import SpecError, schema_from_json

        path = self.values.get("schema")
        if path is None or isinstance(path, dict):  # a dict (Python callers): JobSpec checks it
            return path
        try:
            return schema_from_json(Path(path).read_bytes())
        except OSError as exc:
            raise UserError(f"--schema {path}: cannot read it: {exc.strerror or exc}") from None
        except SpecError as exc:
            raise UserError(f"--schema {path}: {exc}") from None

    def spec(self, *, default_prompt: str | None = None) -> JobSpec:
        """The JobSpec of these options: checked like every other door's (JobSpec), with the
        option at fault named in the message."""
        prompts = self.prompts or ([default_prompt] if default_prompt else [])
        json_schema = self.json_schema()
        ingest, sampling, budget = self.ingest(), self.sampling(), self.budget()
        cache = self.values.get("cache") or "cold"
        return self._checked(
            lambda: JobSpec(
                prompts=prompts,
                json_schema=json_schema,
                sampling=sampling,
                ingest=ingest,
                budget=budget,
                cache=cache,
            )
        )

    def _checked(self, build: Callable[[], Any]) -> Any:
        from pydantic import ValidationError

        try:
            return build()
        except ValidationError as exc:
            fix = "see help(visbatch.run)" if self.python else "see the command's --help"
            raise UserError(describe_option_error(exc, self.values, python=self.python), fix) from None
        except ValueError as exc:
            raise UserError(str(exc)) from None


def describe_option_error(exc: Any, values: dict[str, Any], *, python: bool = False) -> str:
    """pydantic's errors as `--option VALUE: reason` (or `option=VALUE: reason` for Python
    callers), one clause per problem, no URLs."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        field = next((str(part) for part in reversed(error["loc"]) if isinstance(part, str)), "")
        message = error["msg"].removeprefix("Value error, ")
        name = {"prompts": "prompt", "json_schema": "schema"}.get(field, field)
        value = values.get(name)
        plain = value is not None and not isinstance(value, list | dict | bool)
        if python:
            where = f"{name}={value!r}" if plain else (name or "the options")
        else:
            flag = _FIELD_FLAGS.get(field, "--" + field.replace("_", "-") if field else "the options")
            where = f"{flag} {value}" if plain else flag
        problems.append(f"{where}: {message[:1].lower()}{message[1:]}")
    return "; ".join(problems) or str(exc)


def options_of(groups: Sequence[str], *, prompt_required: bool = True) -> list[Opt]:
    opts: list[Opt] = []
    for group in groups:
        opts.extend([prompt_option(prompt_required)] if group == "prompt" else GROUPS[group])
    return opts


def job_options(
    *groups: str, prompt_required: bool = True
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the options of `groups` (default: every job option) in place of its
    `job: JobOptions` parameter."""
    chosen = options_of(groups or JOB_GROUPS, prompt_required=prompt_required)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(fn, eval_str=True).parameters
        if "job" not in own:
            raise TypeError(f"{fn.__name__} needs a `job: JobOptions` parameter")
        params: list[inspect.Parameter] = []
        for name, param in own.items():
            if name != "job":
                params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))
                continue
            params.extend(
                inspect.Parameter(
                    opt.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=opt.annotation,
                    default=inspect.Parameter.empty if opt.default is ... else opt.default,
                )
                for opt in chosen
            )

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {opt.name: kwargs.pop(opt.name) for opt in chosen}
            return fn(job=JobOptions(values), **kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.job_option_names = [opt.name for opt in chosen]  # type: ignore[attr-defined]
        return command

    return decorate
