"""The `visbatch` command group: every command runs inside it.

It does two things for every command, so that no command has to: errors become one or two lines
and an exit code (worker.errors, worker.cli.exits), and help reads plainly at 80 columns
(arguments shown as `PATH...`, not Typer's `{PATH}... <list[Path]>`). It also loads some
commands only when they are asked for (``lazy_commands``): the way click documents for a command
whose module is heavy.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import typer
import typer.main
from typer.core import TyperArgument, TyperGroup

from worker.cli.exits import (
    EXIT_INTERNAL,
    EXIT_USAGE,
    debug_enabled,
    end_quietly_on_broken_pipe,
    exit_code,
    is_broken_pipe,
    report,
)
from worker.errors import UserError, explain, first_line

try:  # typer vendors click (typer._click): its usage errors are not the click package's
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - an older typer on the click package
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError
    from click.globals import get_current_context


def _plain_arguments(command: Any) -> Any:
    """Arguments in help and usage as their metavar (`PATH...`), without a type label."""
    for param in getattr(command, "params", []):
        if isinstance(param, TyperArgument) and not getattr(param, "_visbatch_plain", False):
            name = param.metavar or param.name.upper()
            shown = name if param.nargs == 1 or name.endswith("...") else f"{name}..."
            param._rich_display_name = lambda shown=shown: shown
            param._usage_display_name = lambda shown=shown, required=param.required: (
                shown if required else f"[{shown}]"
            )
            param.display_type_rich = lambda ctx: None
            param._visbatch_plain = True
    for sub in getattr(command, "commands", {}).values():
        _plain_arguments(sub)
    return command


class VisbatchGroup(TyperGroup):
    """The `visbatch` group: runs a command and turns what goes wrong into one or two lines."""

    # Command name -> the module whose Typer ``app`` declares it, imported on first use. Listed
    # first in help, in this order.
    lazy_commands: ClassVar[dict[str, str]] = {}

    def list_commands(self, ctx: Any) -> list[str]:
        eager = [name for name in super().list_commands(ctx) if name not in self.lazy_commands]
        return [*self.lazy_commands, *eager]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self._load(self.lazy_commands[cmd_name])
        command = super().get_command(ctx, cmd_name)
        return _plain_arguments(command) if command is not None else None

    def _load(self, module_name: str) -> None:
        # A Typer app of several commands builds a group: its commands join this one.
        self.commands.update(typer.main.get_group(importlib.import_module(module_name).app).commands)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, NoArgsIsHelpError):
            raise
        except UsageError as exc:
            if debug_enabled(ctx):
                raise
            report(UserError(exc.format_message(), _usage_fix(exc, ctx)))
            raise typer.Exit(EXIT_USAGE) from None
        except ClickException:
            raise
        except Exception as exc:
            if is_broken_pipe(exc):  # `visbatch results JOB | head -1`: the reader has had enough
                raise typer.Exit(end_quietly_on_broken_pipe()) from None
            if debug_enabled(ctx):
                raise
            error = explain(exc)
            if error is None:  # a bug: said plainly, exit 5
                report(
                    UserError(
                        f"unexpected {type(exc).__name__}: {first_line(exc)}",
                        "run again with --debug for the traceback, and report it",
                    )
                )
                raise typer.Exit(EXIT_INTERNAL) from None
            report(error)
            raise typer.Exit(exit_code(error)) from None


def _usage_fix(exc: UsageError, ctx: Any) -> str:
    """The fix of a usage error: where it is about one option, that option's own help line, then
    where the rest is; else the command's --help."""
    context = exc.ctx if exc.ctx is not None else ctx
    param = getattr(exc, "param", None)
    return (param is not None and _help_fix(context, param)) or f"see `{context.command_path} --help`"


def option_fix(flag: str) -> str | None:
    """The running command's option `flag` as a fix (for errors found after parsing: the job
    spec's checks); None outside a command or for a flag it does not have."""
    context = get_current_context(silent=True)
    if context is None:
        return None
    flag = flag.split("/")[0]  # --skip-redundant-frames/--keep-all-frames: the first names it
    param = next((p for p in context.command.params if flag in getattr(p, "opts", ())), None)
    return _help_fix(context, param) if param is not None else None


def _help_fix(context: Any, param: Any) -> str | None:
    """`--limit N: How many, newest first. [default: 20; x>=1] (more: `visbatch jobs --help`)`:
    what the option takes, its default and range, from its own help line."""
    try:
        record = param.get_help_record(context)
    except Exception:  # noqa: BLE001 - a help line that cannot be made: the caller's pointer
        return None
    if not record:
        return None
    names, text = record
    return f"{names}: {' '.join(text.split())} (more: `{context.command_path} --help`)"
