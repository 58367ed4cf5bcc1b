"""The job options (worker.job_options) as typer options: a command takes the groups it needs.

``@job_options(...)`` gives a command the options of its groups in place of its one
``job: JobOptions`` parameter. How: the decorator rewrites the command's signature (Typer reads
``inspect.signature``), putting each option's ``Annotated[type, typer.Option(...)]`` where the
command has ``job``, and gathers their values back into that one object before calling it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from worker.cli.group import option_fix
from worker.job_options import JOB_GROUPS, REQUIRED, JobOptions, Opt, OptionError, options_of

try:  # typer vendors click (typer._click): its context and errors are not the click package's
    from typer._click.core import Context
    from typer._click.exceptions import UsageError
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - an older typer on the click package
    from click import Context, UsageError, get_current_context

# Where JobCommand leaves the order in which a command's options were given.
_ORDER = "visbatch.option_order"


class JobCommand(TyperCommand):
    """A command with job options that also records the order in which they were given: a
    `--then` follows up the `--prompt` before it, which click's values (one list per option)
    no longer say."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        try:
            _, _, order = self.make_parser(ctx).parse_args(args=list(args))
        except UsageError:
            order = []  # the real parse below reports it
        ctx.meta[_ORDER] = [param.name for param in order]
        return super().parse_args(ctx, args)


def _then_after(order: list[str | None]) -> list[int]:
    """For each --then given, the position of the --prompt before it (-1: none)."""
    prompts, after = 0, []
    for name in order:
        if name == "prompt":
            prompts += 1
        elif name == "then":
            after.append(prompts - 1)
    return after


def typer_annotation(opt: Opt) -> Any:
    """The option as Typer reads it from a parameter's annotation."""
    option = typer.Option(*opt.flags, metavar=opt.metavar, help=opt.help, show_default=opt.show_default)
    return Annotated[opt.type, option]


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
                    annotation=typer_annotation(opt),
                    default=inspect.Parameter.empty if opt.default is REQUIRED else opt.default,
                )
                for opt in chosen
            )

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {opt.name: kwargs.pop(opt.name) for opt in chosen}
            ctx = get_current_context(silent=True)
            if values.get("then") and ctx is not None and _ORDER in ctx.meta:
                values["then_after"] = _then_after(ctx.meta[_ORDER])
            try:
                return fn(job=JobOptions(values), **kwargs)
            except OptionError as exc:  # the spec's checks, inside the command: its context is current
                better = option_fix(exc.flag) if exc.flag else None
                raise replace(exc, fix=better or exc.fix) from None

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
