"""The job options, declared once for `run`, `submit`, `plan` (and `ingest`) and the Python API.

A job option is one ``Opt`` here, in its group (inputs, prompt, schema, model, ingest, sampling,
budget, cache): its name, type, default, metavar and help, as plain data. The command line binds
them to typer (worker.cli.job_options: a command takes the groups it needs and gets ONE
parameter, a ``JobOptions``); the Python API (visbatch.api) takes the same options as keyword
arguments. Either way ``JobOptions`` builds the ``JobSpec`` (one place, one validation: the
spec's own) and names the option at fault when a value is refused, as ``--detail ultra`` for the
command and ``detail='ultra'`` for Python (tests/test_python_api.py). Nothing here imports a
command-line library: ``import visbatch`` stays free of typer (tests/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest.budget import DEFAULT_REDUNDANCY_THRESHOLD, VisualBudget
from ingest.spec import IngestOptions, JobSpec, Sampling
from worker.errors import UserError

# The prompt used by `plan` when none is given (it only changes the prompt-token estimate).
DEFAULT_PLAN_PROMPT = "What is on this page or frame? Answer in one sentence."

REQUIRED = ...  # an Opt's default when the option must be given


@dataclass(frozen=True)
class Opt:
    """One job option. ``type`` is the Python type of its value (``int | None``, ``list[str]``
    for a repeatable one); ``flags`` are its spellings when not just ``--name`` (a short form,
    or ``--on/--off`` for a switch)."""

    name: str
    type: Any
    default: Any = None
    metavar: str | None = None
    help: str = ""
    flags: tuple[str, ...] = ()
    show_default: bool = True


# --- the groups --------------------------------------------------------------------------------

# Which files a walked folder contributes (files named on the command line are always taken).
INPUT_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "include",
        list[str] | None,
        metavar="GLOB",
        help="In walked folders take only files matching GLOB (repeatable; e.g. '*.pdf'). "
        "Default: files that are PDFs, videos or images by name or content.",
        show_default=False,
    ),
    Opt(
        "exclude",
        list[str] | None,
        metavar="GLOB",
        help="In walked folders skip files matching GLOB (repeatable).",
        show_default=False,
    ),
)


def prompt_option(required: bool) -> Opt:
    help_text = "A question asked of every page, frame and image (repeatable)."
    if required:
        return Opt("prompt", list[str], REQUIRED, "TEXT", help_text, ("--prompt", "-p"))
    return Opt(
        "prompt",
        list[str] | None,
        None,
        "TEXT",
        help_text + " Default: a one-sentence description.",
        ("--prompt", "-p"),
    )


SCHEMA_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "schema",
        Path | None,
        metavar="FILE",
        help="JSON schema file: every answer is JSON constrained to it.",
    ),
)

MODEL_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "model",
        str | None,
        metavar="ID|DIR",
        help="Hub id or local folder. Default: $VISBATCH_MODEL, else this folder's "
        "(`visbatch model use`), else Qwen/Qwen2-VL-2B-Instruct.",
        show_default=False,
    ),
)

# How sources become images: every field of ingest.spec.IngestOptions, and nothing else.
# (One place: a new option that is an IngestOptions field is this one line; JobOptions.ingest
# passes it on by name.)
INGEST_OPTIONS: tuple[Opt, ...] = (
    Opt("longest_side", int | None, 1288, "PX", "PDF pages: longest side in pixels."),
    Opt("dpi", int | None, None, "N", "PDF pages: render at N DPI instead."),
    Opt("pages", str | None, None, "RANGES", "PDF pages to take, from 1: '1-3,7'."),
    Opt("fps", float | None, None, "F", "Video: frames sampled per second (default 1.0)."),
    Opt("num_frames", int | None, None, "N", "Video: N frames spread evenly (instead of --fps)."),
    Opt("max_frames", int, 64, "N", "Video: at most N frames, 64 by default (spread over the whole video)."),
    Opt(
        "keyframes",
        bool,
        False,
        help="Video: take the keyframe nearest to each sample when samples are sparser than "
        "keyframes (near-flat cost on long videos; timestamps are the keyframes').",
        flags=("--keyframes",),
    ),
)

SAMPLING_OPTIONS: tuple[Opt, ...] = (
    Opt("max_new_tokens", int, 256, "N", "Tokens generated at most per answer."),
    Opt("temperature", float, 0.0, "T", "Sampling temperature; 0 = greedy."),
    Opt("top_p", float, 1.0, "P", "Nucleus sampling: the top probability mass kept."),
    Opt("seed", int, 0, "N", "Sampling seed (answers are reproducible)."),
)

# The visual-token budget (ingest.budget.VisualBudget; docs/budget.md).
BUDGET_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "detail",
        str | None,
        None,
        "LEVEL",
        "Visual detail: low, medium, high (at most 256/640/1280 tokens per image) or auto "
        "(from the prompts: fine text -> high, coarse questions -> low, else medium). "
        "Default: the model's own resize bounds.",
    ),
    Opt("min_pixels", int | None, None, "N", "Processor's min pixels per image (overrides --detail)."),
    Opt("max_pixels", int | None, None, "N", "Processor's max pixels per image (overrides --detail)."),
    Opt("max_tokens_per_frame", int | None, None, "N", "At most N visual tokens per page, image or frame."),
    Opt(
        "max_tokens_per_video",
        int | None,
        None,
        "N",
        "At most N visual tokens per video (its frames get smaller).",
    ),
    Opt(
        "skip_redundant_frames",
        bool,
        True,
        help="Video: skip frames that nearly repeat the last kept one (recorded as skipped).",
        flags=("--skip-redundant-frames/--keep-all-frames",),
    ),
    Opt(
        "redundancy_threshold",
        float,
        DEFAULT_REDUNDANCY_THRESHOLD,
        "D",
        "Skip a frame below this mean difference (0-255) of 32x32 RGB thumbnails.",
    ),
    Opt(
        "prune_keep",
        float,
        1.0,
        "F",
        "transformers engine: keep this share of each image's visual tokens (1 = off).",
    ),
    Opt(
        "merge_keep",
        float,
        1.0,
        "F",
        "transformers engine: merge the most similar neighbouring visual tokens (averaging) until "
        "this share of each image's tokens is left (1 = off); before --prune-keep.",
    ),
    Opt(
        "drop_static",
        float,
        0.0,
        "D",
        "With --window, transformers engine: leave out a frame's visual tokens that changed by less "
        "than D (relative, e.g. 0.1) since the window last showed them; positions kept (0 = off).",
    ),
)

# Where the job's visual tokens are kept (ingest.spec.CachePolicy; docs/scale.md).
CACHE_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "cache",
        str,
        "cold",
        "POLICY",
        "Token cache: cold (Redis + S3, or the local folder: kept for reruns and other jobs), "
        "hot (Redis alone, expires), none (deleted once the page is answered).",
    ),
)

# What each request sees and asks beyond one unit and one question (ingest.windows, the
# spec's `then`; docs/windows.md).
ASKING_OPTIONS: tuple[Opt, ...] = (
    Opt(
        "window",
        str | None,
        None,
        "WINDOW",
        "N[:S]: each prompt sees N consecutive pages or frames, a window every S (default S=N); "
        "Ts[:Ss]: a video's frames of each T seconds (10s:5s); all: the whole source. "
        "Default: one page or frame a prompt.",
    ),
    Opt(
        "then",
        list[str] | None,
        None,
        "TEXT",
        "A follow-up turn after the preceding --prompt (repeatable): it sees the same pages or "
        "frames, the earlier turns and their answers; one answer per turn.",
        show_default=False,
    ),
    Opt(
        "summarize",
        str | None,
        None,
        "TEXT",
        "Once a source's answers are all in, ask TEXT of them (each with its page or time): one "
        "summary row per source.",
        show_default=False,
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
    "asking": ASKING_OPTIONS,
}
# What `run`, `submit` and `plan` take: everything that goes into a job.
JOB_GROUPS = ("prompt", "inputs", "schema", "model", "ingest", "sampling", "budget", "cache", "asking")


def options_of(groups: Sequence[str], *, prompt_required: bool = True) -> list[Opt]:
    opts: list[Opt] = []
    for group in groups:
        opts.extend([prompt_option(prompt_required)] if group == "prompt" else GROUPS[group])
    return opts


# A spec field (pydantic's error location) -> the option that sets it, to name it in errors.
_FIELD_FLAGS = {
    "prompts": "--prompt",
    "json_schema": "--schema",
    "skip_redundant_frames": "--skip-redundant-frames/--keep-all-frames",
}


@dataclass
class OptionError(UserError):
    """A command-line job option refused by the job spec's checks. `flag` is the first option
    named: the command line (worker.cli.job_options) gives that option's own help line as the
    fix, which this module cannot (it knows no command)."""

    flag: str | None = None


class JobOptions:
    """The values of a command's (or a Python call's) job options, and the JobSpec they make."""

    def __init__(self, values: dict[str, Any], *, python: bool = False) -> None:
        self.values = values
        self.python = python  # errors name `detail='ultra'` (Python callers), else `--detail ultra`

    @classmethod
    def with_defaults(cls, given: dict[str, Any], *, python: bool = True) -> JobOptions:
        """Every job option at its declared default, then `given` (the Python API's keywords)."""
        declared = options_of(JOB_GROUPS, prompt_required=False)
        values = {opt.name: (None if opt.default is REQUIRED else opt.default) for opt in declared}
        values.update(given)
        return cls(values, python=python)

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
            raise UserError(f"{self._given('schema', path)}: cannot read it: {exc.strerror or exc}") from None
        except SpecError as exc:
            raise UserError(f"{self._given('schema', path)}: {exc}") from None

    def spec(self, *, default_prompt: str | None = None) -> JobSpec:
        """The JobSpec of these options: checked like every other door's (JobSpec), with the
        option at fault named in the message."""
        prompts = self.prompts or ([default_prompt] if default_prompt else [])
        json_schema = self.json_schema()
        ingest, sampling, budget = self.ingest(), self.sampling(), self.budget()
        cache = self.values.get("cache") or "cold"
        then = self.then(prompts)
        return self._checked(
            lambda: JobSpec(
                prompts=prompts,
                json_schema=json_schema,
                sampling=sampling,
                ingest=ingest,
                budget=budget,
                cache=cache,
                window=self.values.get("window"),
                then=then,
                summarize=self.values.get("summarize"),
            )
        )

    def then(self, prompts: list[str]) -> list[list[str]]:
        """The follow-up turns per prompt. The command line says which --prompt each --then
        follows (`then_after`: its position, worker.cli.job_options); a Python caller gives one
        list per prompt, or one list for a single prompt."""
        given = list(self.values.get("then") or [])
        if not given:
            return []
        after = self.values.get("then_after")
        if after is not None:
            if min(after) < 0:
                raise UserError(
                    "--then before any --prompt: a follow-up turn continues the --prompt before it",
                    "write each --then after the --prompt it follows up",
                )
            turns: list[list[str]] = [[] for _ in prompts]
            for position, text in zip(after, given, strict=True):
                turns[position].append(text)
            return turns
        if all(isinstance(turn, str) for turn in given):
            if len(prompts) != 1:
                raise UserError(
                    f"then={given!r} with {len(prompts)} prompts: which prompt does it follow?",
                    "give one list of follow-ups per prompt: then=[['...'], ['...']]",
                )
            return [given]
        return [list(turns) for turns in given]

    def _given(self, name: str, value: Any) -> str:
        """The option and its value as the caller wrote them."""
        return f"{name}={value!r}" if self.python else f"--{name.replace('_', '-')} {value}"

    def _checked(self, build: Callable[[], Any]) -> Any:
        from pydantic import ValidationError

        try:
            return build()
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            message = describe_option_error(exc, self.values, python=self.python)
            if self.python:
                raise UserError(message, "see help(visbatch.run)") from None
            field = _field_of(errors[0]) if errors else ""
            flag = _flag_of(field) if field else None  # none for the spec as a whole
            raise OptionError(message, "see the command's --help", flag=flag) from None
        except ValueError as exc:
            raise UserError(str(exc)) from None


def _field_of(error: dict[str, Any]) -> str:
    """The job-spec field a pydantic error is about ("" for the spec as a whole)."""
    return next((str(part) for part in reversed(error["loc"]) if isinstance(part, str)), "")


def _flag_of(field: str) -> str:
    return _FIELD_FLAGS.get(field, "--" + field.replace("_", "-") if field else "the options")


def describe_option_error(exc: Any, values: dict[str, Any], *, python: bool = False) -> str:
    """pydantic's errors as `--option VALUE: reason` (or `option=VALUE: reason` for Python
    callers), one clause per problem, no URLs."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        field = _field_of(error)
        message = error["msg"].removeprefix("Value error, ")
        name = {"prompts": "prompt", "json_schema": "schema"}.get(field, field)
        value = values.get(name)
        plain = value not in (None, "") and not isinstance(value, list | dict | bool)
        if python:
            where = f"{name}={value!r}" if plain else (name or "the options")
        else:
            flag = _flag_of(field)
            where = f"{flag} {value}" if plain else flag
        problems.append(f"{where}: {message[:1].lower()}{message[1:]}")
    return "; ".join(problems) or str(exc)
