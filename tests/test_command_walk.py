"""Every command walked with the third day's causes (issue 31, items 4 and 5): another current
folder, a mistyped database path, an empty PostgreSQL database, and negative and zero numbers
for every numeric option of every command.

What a user sees is the behaviour: real `visbatch` processes at 80 columns with stdout and stderr
in pipes, each in a folder of its own with no VISBATCH_HOME; the numeric options are enumerated
from the Typer app itself (a new option joins the walk by being declared) and checked in this
process through Typer's runner, then once per command as a real process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from tests.media import write_pdf
from tests.test_first_hour import VISBATCH, Done, _error_lines

UNSET = "the current folder's .visbatch: VISBATCH_HOME and VISBATCH_DATABASE_URL unset"


def _env(**extra: str) -> dict[str, str]:
    """A user's environment: no VISBATCH_* at all (the database is the current folder's), 80
    columns, no terminal."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISBATCH_")}
    env.pop("TERM", None)
    root = str(Path(__file__).resolve().parents[1])
    env.update(COLUMNS="80", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


def visbatch(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Done:
    done = subprocess.run(
        [VISBATCH, *args],
        env=env or _env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return Done(done.returncode, done.stdout, done.stderr, 0.0)


def _plain(done: Done, code: int) -> list[str]:
    """The error's two lines, checked: the exit code, `error:` then `fix:`, never "report it"."""
    assert done.rc == code, (done.rc, done.out, done.err)
    assert "unexpected" not in done.err and "report it" not in done.err and "Traceback" not in done.err
    lines = _error_lines(done.err)
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("fix: "), done.err
    return lines


def _folder(tmp_path: Path, name: str = "elsewhere") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


# 4. State does not silently depend on the current folder ------------------------------------------
# The commands that only read, or change only what is stored: they never make a database.
READING = {
    "status": ["status", "feedbeef00"],
    "status --json": ["status", "feedbeef00", "--json"],
    "jobs": ["jobs"],
    "results": ["results", "feedbeef00"],
    "view": ["view", "feedbeef00", "--out", "site"],
    "compare": ["compare", "feedbeef00", "feedbeef01"],
    "cancel": ["cancel", "feedbeef00"],
    "purge": ["purge", "--older-than", "30d"],
    "resume": ["resume", "feedbeef00"],  # it writes, but only to a job that is there
}


@pytest.mark.parametrize("command", list(READING))
def test_reading_in_another_folder_names_the_file_and_creates_nothing(tmp_path, command):
    folder = _folder(tmp_path)
    lines = _plain(visbatch(folder, *READING[command]), 4)
    assert lines[0] == f"error: no visbatch database at {folder / '.visbatch' / 'visbatch.db'} ({UNSET})"
    assert "VISBATCH_HOME" in lines[1] and "visbatch run" in lines[1]
    assert list(folder.iterdir()) == []  # no .visbatch, no site folder


def test_the_python_api_reads_without_making_a_database(tmp_path):
    """`visbatch.jobs()` and `visbatch.job(ID)` in a script run elsewhere: visbatch.Unavailable
    (the command's exit 4) with the same words, and no .visbatch left in that folder."""
    folder = _folder(tmp_path)
    code = (
        "import visbatch\n"
        "for call in (visbatch.jobs, lambda: visbatch.job('feedbeef00')):\n"
        "    try:\n        call()\n"
        "    except visbatch.Unavailable as exc:\n        print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=folder, env=_env(), capture_output=True, text=True, timeout=60
    )
    said = f"Unavailable no visbatch database at {folder / '.visbatch' / 'visbatch.db'} ({UNSET})"
    assert done.stdout.splitlines() == [said, said], done.stdout + done.stderr
    assert list(folder.iterdir()) == []


def test_a_mistyped_database_path_is_named_and_not_created(tmp_path):
    folder = _folder(tmp_path)
    typo = tmp_path / "projcet" / "visbatch.db"
    done = visbatch(folder, "jobs", env=_env(VISBATCH_DATABASE_URL=f"sqlite:///{typo}"))
    lines = _plain(done, 4)
    assert lines[0] == f"error: no visbatch database at {typo} (from VISBATCH_DATABASE_URL)"
    assert lines[1].startswith("fix: correct VISBATCH_DATABASE_URL")
    home = tmp_path / "no-home"
    done = visbatch(folder, "status", "feedbeef00", env=_env(VISBATCH_HOME=str(home)))
    lines = _plain(done, 4)
    assert lines[0] == (
        f"error: no visbatch database at {home / 'visbatch.db'} (under VISBATCH_HOME={home}; "
        "VISBATCH_DATABASE_URL unset)"
    )
    assert not typo.parent.exists() and not home.exists() and list(folder.iterdir()) == []


@pytest.mark.parametrize("command", ["status", "results", "view", "compare", "cancel"])
def test_no_job_names_the_database_it_looked_in(tmp_path, command):
    folder = _folder(tmp_path)
    made = visbatch(folder, "db", "upgrade")
    assert made.rc == 0 and "migrated from empty" in made.err, made.err
    database = folder / ".visbatch" / "visbatch.db"
    lines = _plain(visbatch(folder, *READING[command]), 2)
    assert lines[0] == f"error: no job 'feedbeef00' in {database} ({UNSET})"
    assert "visbatch jobs" in lines[1] and "another folder" in lines[1]


def test_an_empty_postgresql_database_is_told_not_migrated_by_reading(tmp_path):
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from storage.db import Database, head_revision
    from tests.conftest import _postgres_base_url, _require_postgres
    from visbatch.settings import Settings
    from worker.runtime import Runtime

    _require_postgres()
    name = f"visbatch_t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(_postgres_base_url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(_postgres_base_url()).set(database=name, password="pw-never-shown")
    env = _env(VISBATCH_DATABASE_URL=url.render_as_string(hide_password=False))
    shown = url.render_as_string(hide_password=True)
    folder = _folder(tmp_path)
    try:
        for args in (["jobs"], ["status", "feedbeef00"]):
            lines = _plain(visbatch(folder, *args, env=env), 4)
            assert (
                lines[0]
                == f"error: the database {shown} holds no visbatch tables (from VISBATCH_DATABASE_URL)"
            )
            assert "visbatch db upgrade" in lines[1] and "pw-never-shown" not in lines[0] + lines[1]
        engine = create_engine(url)
        with engine.connect() as connection:
            tables = connection.execute(text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"))
            assert tables.scalar_one() == 0, "reading created tables"
        engine.dispose()
        # An older migration is told too, with the same fix (reading never migrates it).
        db = Database(url.render_as_string(hide_password=False))
        db.upgrade()
        older = f"{int(head_revision()) - 1:04d}"
        db.downgrade(older)
        lines = _plain(visbatch(folder, "jobs", env=env), 4)
        assert f"is at migration {older}, older than this visbatch's {head_revision()}" in lines[0]
        assert db.current_revision() == older
        # The commands that start work (run, submit, a worker) make the tables, and say so.
        db.downgrade("base")
        told: list[tuple[str | None, str]] = []
        settings = Settings(home=tmp_path / "home", database_url=url.render_as_string(hide_password=False))
        rt = Runtime(settings, on_migrated=lambda _db, migrated: told.append(tuple(migrated)))
        assert rt.db.current_revision() == head_revision() and told == [(None, head_revision())]
        rt.db.dispose()
        db.dispose()
        assert visbatch(folder, "jobs", env=env).rc == 0
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.mark.slow
def test_the_first_run_in_a_fresh_folder_makes_the_database_and_says_where(tmp_path, tiny_model_dir):
    """The README's first command on a fresh clone: `visbatch run` (the embedded default) makes
    the current folder's .visbatch/visbatch.db, once, and says where; the folder's reads find it."""
    folder = _folder(tmp_path)
    pdf = write_pdf(tmp_path / "a.pdf", pages=1)
    env = _env(VISBATCH_MODEL=str(tiny_model_dir))
    done = visbatch(folder, "run", str(pdf), "-p", "Hi", "--max-new-tokens", "1", env=env)
    assert done.rc == 0, done.err
    database = folder / ".visbatch" / "visbatch.db"
    assert database.is_file()
    assert done.err.splitlines()[0] == f"created the database {database} ({UNSET})"
    listed = visbatch(folder, "jobs", env=env)
    assert listed.rc == 0 and done.out.split()[0][:12] in listed.out, listed.err
    again = visbatch(folder, "db", "upgrade", env=env)
    assert again.rc == 0 and "already at the latest migration" in again.err


# 5. Negative and zero numbers for every numeric option ---------------------------------------------
# What each command needs besides the option tried: inputs that do not exist, so that a value
# wrongly let through ends in another error at once (never a started job, a worker or a server).
BASE_ARGS: dict[str, list[str]] = {
    "run": ["nope.pdf", "-p", "Hi"],
    "resume": ["feedbeef00"],
    "submit": ["nope.pdf", "-p", "Hi"],
    "ingest": ["nope.pdf", "--out", "pages"],
    "plan": ["nope.pdf"],
    "watch": ["s3://bucket/inbox/", "--log-level", "nope"],
    "worker": ["--queues", "nope"],
    "jobs": [],
    "view": ["feedbeef00", "--out", "site"],
    "compare": ["feedbeef00", "feedbeef01"],
    "model tiny": ["tiny"],
}
# Where 0 means something (the option's help says what); every other numeric option refuses it.
ZERO_MEANS = {
    "temperature": "greedy decoding, the default",
    "seed": "a seed like any other, the default",
    "redundancy_threshold": "skip no frame",
    "gpu_cost_per_hour": "GPUs already paid for",
    "s3_gb_month": "a store without that fee (MinIO)",
    "s3_put_1000": "a store without that fee",
    "s3_get_1000": "a store without that fee",
    "port": "view: any free port, printed",
    "metrics_port": "worker: any free port, named in its log (`run` refuses 0: it prints no port)",
    "limit": "compare: counts only, no page listed (`jobs` refuses 0)",
    "show": "compare: no differing answer printed",
    "drop_static": "no static patch left out of a window, the default",
}
ZERO_REFUSED_BY = {("run", "metrics_port"), ("resume", "metrics_port"), ("jobs", "limit")}


def _numeric_options() -> dict[str, list[tuple[str, str]]]:
    """{command path: [(parameter name, --flag)]} for every int or float option, from the app."""
    from worker.cli.main import app

    found: dict[str, list[tuple[str, str]]] = {}

    def walk(command, path: list[str]) -> None:
        if hasattr(command, "list_commands"):
            for name in command.list_commands(None):
                walk(command.get_command(None, name), [*path, name])
            return
        for param in command.params:
            # click's number types (ranges too), whichever click typer uses (its own or the package)
            kinds = {cls.__name__ for cls in type(param.type).__mro__}
            numeric = bool(kinds & {"IntParamType", "FloatParamType"})
            if param.param_type_name == "option" and numeric:
                flag = next(opt for opt in param.opts if opt.startswith("--"))
                found.setdefault(" ".join(path), []).append((param.name, flag))

    walk(get_command(app), [])
    return found


NUMERIC = _numeric_options()


def test_the_walk_knows_every_command_with_a_numeric_option():
    assert set(NUMERIC) == set(BASE_ARGS), "give a new command its base arguments in BASE_ARGS"
    assert len([o for options in NUMERIC.values() for o in options]) >= 60  # the job options x3, ...


def _zero_is_accepted(command: str, name: str) -> bool:
    return name in ZERO_MEANS and (command, name) not in ZERO_REFUSED_BY


@pytest.mark.parametrize("command", sorted(NUMERIC))
def test_every_numeric_option_refuses_negative_and_zero_up_front(command, tmp_path, monkeypatch):
    """In this process through Typer's runner (the same group, errors and exit codes as the
    command): -1 is refused for every option, 0 wherever it means nothing, with exit 2 and the
    option named, before anything is started; a 0 that means something parses."""
    from worker.cli.main import app

    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("VISBATCH_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("VISBATCH_MODEL", str(tmp_path / "no-model"))
    monkeypatch.setenv("VISBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    words = command.split()
    click_command = get_command(app)
    for word in words:
        click_command = click_command.get_command(None, word)
    runner = CliRunner()
    for name, flag in NUMERIC[command]:
        for value in ("-1", "0"):
            args = [*BASE_ARGS[command], flag, value]
            if value == "0" and _zero_is_accepted(command, name):
                click_command.make_context(command, list(args))  # parses: no BadParameter
                continue
            done = runner.invoke(app, [*words, *args])
            lines = _error_lines(done.output)
            assert done.exit_code == 2, (command, flag, value, done.output)
            assert lines[0].startswith("error: ") and flag in lines[0], (command, flag, value, done.output)
            # The fix is the option's own help line (what it takes, its range), not just "see --help".
            assert lines[1].startswith("fix: -") and f"{flag} " in lines[1], (command, flag, lines)
            assert "unexpected" not in done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing made: no database, no folder


@pytest.mark.parametrize("command", sorted(NUMERIC))
def test_a_negative_number_as_a_user_meets_it(command, tmp_path):
    """The real command, at 80 columns in a pipe, in a folder of its own: two lines, exit 2."""
    name, flag = NUMERIC[command][0]
    folder = _folder(tmp_path)
    done = visbatch(folder, *command.split(), *BASE_ARGS[command], flag, "-1")
    lines = _plain(done, 2)
    assert flag in lines[0] and done.out == "", done.err
    assert list(folder.iterdir()) == []


def test_plan_refuses_a_negative_cost_before_printing_the_table(tmp_path):
    pdf = write_pdf(tmp_path / "doc.pdf", pages=1)
    done = visbatch(tmp_path, "plan", str(pdf), "--throughput", "20000", "--gpu-cost-per-hour", "-1")
    lines = _plain(done, 2)  # was: the table, then "unexpected ValueError: math domain error", exit 5
    # click's words for the range (typer before 0.29; pyproject keeps it there)
    assert lines[0] == "error: Invalid value for '--gpu-cost-per-hour': -1.0 is not in the range x>=0."
    # The option's own help line, not only a pointer to the whole --help (was "see `... --help`").
    assert lines[1] == (
        "fix: --gpu-cost-per-hour USD: USD per GPU-hour (with --throughput). [x>=0] "
        "(more: `visbatch plan --help`)"
    )
    assert done.out == ""


def test_plan_says_a_cost_without_throughput_is_not_used(tmp_path, tiny_model_dir):
    pdf = write_pdf(tmp_path / "doc.pdf", pages=1)
    env = _env(VISBATCH_MODEL=str(tiny_model_dir))
    note = "note: --gpu-cost-per-hour needs --throughput (your measured rate): no cost without it"
    done = visbatch(tmp_path, "plan", str(pdf), "--gpu-cost-per-hour", "3", env=env)
    assert done.rc == 0 and note in done.out.splitlines(), done.out + done.err
    as_json = visbatch(tmp_path, "plan", str(pdf), "--gpu-cost-per-hour", "3", "--json", env=env)
    plan = json.loads(as_json.out)
    assert plan["cost_usd"] is None and note.removeprefix("note: ") in plan["notes"]
    free = visbatch(tmp_path, "plan", str(pdf), "--throughput", "20000", "--gpu-cost-per-hour", "0", env=env)
    assert free.rc == 0 and ", $0.00, $0.00 per million pages/frames" in free.out, free.out + free.err
    assert "needs --throughput" not in free.out


# 7 and 11. Help and tables whole at 80 columns -----------------------------------------------------
SUMMARY_LIMIT = 65  # click's room for a summary at 80 columns: 78 - 6 - the longest name (7)


def _commands(command=None, path: tuple[str, ...] = ()):
    """(path, click command) of every command and group of the app, depth first."""
    from worker.cli.main import app

    command = command or get_command(app)
    if path:
        yield path, command
    if hasattr(command, "list_commands"):
        for name in command.list_commands(None):
            yield from _commands(command.get_command(None, name), (*path, name))


def test_every_command_summary_is_a_whole_phrase_at_80_columns(tmp_path):
    """`visbatch --help` (and `model --help`, `db --help`) at 80 columns in a pipe: each command's
    summary is its help's first line, a whole sentence (was: "Continue a stopped job (cancelled,
    interrupted, failed or..." cut mid-phrase by click's limit)."""
    groups = {(): "visbatch --help"} | {p: " ".join(p) for p, c in _commands() if hasattr(c, "commands")}
    for group, label in groups.items():
        done = visbatch(tmp_path, *group, "--help")
        assert done.rc == 0, (label, done.err)
        rows = done.out.split("Commands:\n", 1)[1].splitlines()
        listed = {row.split()[0]: row.split(None, 1)[1] for row in rows if row.startswith("  ")}
        children = {p[-1]: c for p, c in _commands() if p[:-1] == group}
        assert set(listed) == set(children), label
        for name, summary in listed.items():
            first = children[name].help.strip().split("\n\n")[0]
            assert "\n" not in first, f"{label} {name}: its first line is its summary: {first!r}"
            assert summary == first and summary.endswith(".") and "..." not in summary, (name, summary)
            assert len(summary) <= SUMMARY_LIMIT, (name, summary)
    assert "fleet or embedded" in visbatch(tmp_path, "--help").out  # `cancel` stops either (item 11)


UPPER_WORDS = re.compile(r"[A-Z][A-Z0-9_]*(\|[A-Z][A-Z0-9_]*)*(\.\.\.)?")


def test_every_option_has_help_and_an_upper_case_metavar():
    """Every option of every command, from the app: help text, and a value shown as a word in
    capitals (FILE, N, ID|DIR), never Typer's `<path>`, `<int range>`, `<str>`, `<list[str]>`."""
    seen = 0
    for path, command in _commands():
        if hasattr(command, "commands"):
            continue
        ctx = command.make_context(" ".join(path), [], resilient_parsing=True)
        for param in command.params:
            if param.param_type_name == "argument":
                shown = param.metavar or param.name.upper()
                assert UPPER_WORDS.fullmatch(shown), (path, param.name, shown)
                continue
            if param.hidden:
                continue
            seen += 1
            assert (param.help or "").strip(), f"visbatch {' '.join(path)} {param.opts[-1]}: no help"
            if param.is_flag:
                continue
            names, _ = param.get_help_record(ctx)
            metavar = names.split()[-1]
            assert UPPER_WORDS.fullmatch(metavar), f"visbatch {' '.join(path)}: {names}"
    assert seen > 100


def test_times_are_written_one_way():
    """A frame's time in `run`'s answers, `status`'s errors, `results --by-document`, `compare`
    and the review pages: one format (was 0:03.0 in the terminal beside 0:03.000 on the pages)."""
    from worker.results_export import format_timestamp, place
    from worker.review.html import fmt_timestamp

    for seconds in (0.0, 3.0, 2.4667, 59.9996, 61.25, 3725.5):
        assert format_timestamp(seconds) == fmt_timestamp(seconds)
    assert format_timestamp(3.0) == "0:03.000" and format_timestamp(3725.5) == "1:02:05.500"
    assert place("video", 3, 3.0) == "frame at 0:03.000"


def test_plan_at_80_columns_cuts_nothing_and_says_where_its_model_comes_from(tmp_path, tiny_model_dir):
    """The table whole in a pipe at 80 columns (was `pages/fram…`), a long file name wrapped in its
    column, a file that cannot be read named below it; and the model's origin, as `run` says it."""
    write_pdf(tmp_path / "annual-report-of-the-northern-region-2025-final.pdf", pages=2)
    write_pdf(tmp_path / "invoice.pdf", pages=1)
    (tmp_path / "notes.pdf").write_text("just some text")
    env = _env(VISBATCH_MODEL=str(tiny_model_dir))
    done = visbatch(tmp_path, "plan", str(tmp_path), env=env)
    assert done.rc == 0, done.err
    table = done.out.split("\nmodel ", 1)[0]
    assert "…" not in done.out and "..." not in table, done.out
    assert all(len(line) <= 80 for line in table.splitlines()), table
    header = " ".join(table.splitlines()[:2]).split()
    assert header == ["pages+", "visual", "prompt", "KV", "per", "source", "kind", "frames", "tokens",
                      "tokens", "request"], table  # fmt: skip
    assert "invoice.pdf" in table and "notes.pdf" in table and "error: notes.pdf: not a PDF" in done.out
    assert done.err.splitlines()[0] == f"model: {tiny_model_dir} (from VISBATCH_MODEL)", done.err
    named = visbatch(tmp_path, "plan", str(tmp_path / "invoice.pdf"), "--model", str(tiny_model_dir))
    assert named.rc == 0 and f"model: {tiny_model_dir} (from --model)" in named.err, named.err
    assert "model: " not in named.out  # stdout keeps the plan (and --json its JSON)


def test_submit_to_a_broker_that_is_down_makes_no_job(tmp_path):
    """Was: a `failed` job whose id was never printed (the broker is tried after the job's rows)."""
    write_pdf(tmp_path / "a.pdf", pages=1)
    folder = _folder(tmp_path)
    env = _env(VISBATCH_BROKER_URL="redis://127.0.0.1:1/0")
    done = visbatch(folder, "submit", str(tmp_path / "a.pdf"), "-p", "Hi", env=env)
    assert done.rc == 4 and done.out == "", done.err
    lines = _error_lines(done.err)
    assert lines[0].startswith("created the database "), done.err  # it says where, as a first run does
    assert lines[1].startswith("error: cannot reach the broker redis://127.0.0.1:1/0"), done.err
    assert lines[2].startswith("fix: ") and lines[2].endswith("no job was made: submit again then")
    listed = visbatch(folder, "jobs", env=env)
    assert listed.rc == 0 and len(listed.out.splitlines()) == 1, listed.out  # the header alone


def test_run_names_the_inputs_it_cannot_read_before_the_model(tmp_path):
    """A text file named .pdf among good files: the job goes on with the others (docs/cli.md), and
    says so at once, before the model is named or loaded (was: in the summary, after the run)."""
    folder = _folder(tmp_path, "docs")
    write_pdf(folder / "invoice.pdf", pages=1)
    (folder / "notes.pdf").write_text("just some text")
    env = _env(VISBATCH_MODEL=str(tmp_path / "no-model"))  # exit 4 at the model: no job run
    done = visbatch(tmp_path, "run", str(folder), "-p", "Hi", env=env)
    assert done.rc == 4, done.err
    lines = done.err.splitlines()
    assert lines[2].startswith("created the database ") and lines[3].startswith("model: "), done.err
    assert lines[:2] == [
        "warning: docs/notes.pdf: not a PDF (no %PDF- header in its first 1 KiB)",
        "warning: the job runs the other 1 file(s); 1 will be failed source(s) "
        "(the job ends partial at best)",
    ], done.err
