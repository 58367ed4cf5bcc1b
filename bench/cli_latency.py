"""Q13b. `visbatch status` and `visbatch jobs` as processes, this checkout against another commit,
side by side in one run, beside the floor of the libraries every command imports.

Arms, interleaved (the order flips every repetition), each a whole process with its start-up:

  python -c pass    the interpreter's own start
  floor             `import sqlalchemy, typer.main, rich.console, rich.table`: SQLAlchemy Core,
                    typer (below 0.29: no pydantic for its parameters), rich; before any visbatch code
  status, jobs      this checkout (`visbatch status JOB`, `visbatch jobs`)
  status@REV, ...   the same commands with the code of REV (`git archive`, on PYTHONPATH)
  status, no pyc    this checkout's code without bytecode (a copy with no __pycache__ and
                    PYTHONDONTWRITEBYTECODE=1, as some environments run: every module compiled)
  status, +site     with `--site DIR`: this checkout with DIR first on the path, e.g. another
                    release of a library (`pip install --no-deps --target DIR typer==0.29.2`)

Each tree's job is a real one (`visbatch run`, tiny model, 2 pages) in a home of its own, so
that an older commit reads a database of its own migration. Bytecode is written before timing
(one warm-up call per arm) except for the `no pyc` arm.

    python -m bench.cli_latency --against c671ae3 --reps 9 [--code e87db09] [--site DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, Check, bars, interleaved, median, paired_ratio, rounded, run, write_result
from bench.media import report_pdf
from bench.models import bench_model

PACKAGES = ("visbatch", "worker", "storage", "ingest", "migrations")
CLI = "from worker.cli.main import app; app(prog_name='visbatch')"
FLOOR = "import sqlalchemy, typer.main, rich.console, rich.table"


def _export(rev: str, into: Path) -> Path:
    """The code of `rev` in `into` (git archive: only committed files)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _copy_without_bytecode(tree: Path, into: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(tree / name, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def _env(tree: Path, home: Path, *, bytecode: bool = True, site: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISBATCH_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    path = str(tree) if site is None else f"{site}{os.pathsep}{tree}"
    env.update(PYTHONPATH=path, VISBATCH_HOME=str(home), VISBATCH_MODEL=str(bench_model("tiny")))
    return env


def _job(env: dict[str, str], tree: Path) -> str:
    pdf = report_pdf(2, variant="cli")
    argv = [sys.executable, "-c", CLI, "run", str(pdf), "-p", "hi", "--max-new-tokens", "2"]
    return run(argv, env=env, cwd=tree, text=True).stdout.strip().splitlines()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the commit to compare with (default HEAD)")
    parser.add_argument(
        "--code", default=None, help="measure this commit instead of the checkout (others may be editing it)"
    )
    parser.add_argument("--site", default=None, help="also this checkout with DIR first on the path")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="3 repetitions")
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    rev = args.against
    with tempfile.TemporaryDirectory(prefix="bench-cli-latency-") as tmp:
        base = Path(tmp)
        code = ROOT if args.code is None else _export(args.code, base / "code")
        trees = {
            "": (code, True),
            f"@{rev}": (_export(rev, base / "rev"), True),
            ", no pyc": (_copy_without_bytecode(code, base / "nopyc"), False),
        }
        if args.site:
            trees[", +site"] = (code, True)
        # Each process runs in its tree: `python -c` puts the current folder first on sys.path.
        commands: dict[str, tuple[list[str], dict[str, str], Path]] = {
            "python -c pass": ([sys.executable, "-c", "pass"], _env(ROOT, base / "home"), base),
            "floor": ([sys.executable, "-c", FLOOR], _env(ROOT, base / "home"), base),
        }
        for number, (suffix, (tree, bytecode)) in enumerate(trees.items()):
            home = base / f"home-{number}"
            site = args.site if suffix == ", +site" else None
            env = _env(tree, home, bytecode=True, site=site)
            where = run(
                [sys.executable, "-c", "import worker; print(worker.__file__)"], env=env, cwd=tree, text=True
            )
            if not where.stdout.startswith(str(tree)):  # the code measured is the tree's, not an install
                raise RuntimeError(f"{tree}: imports worker from {where.stdout.strip()}")
            job = _job(env, tree)  # bytecode on: the no-pyc copy's is removed below
            env = _env(tree, home, bytecode=bytecode, site=site)
            commands[f"status{suffix}"] = ([sys.executable, "-c", CLI, "status", job], env, tree)
            if suffix != ", no pyc":
                commands[f"jobs{suffix}"] = ([sys.executable, "-c", CLI, "jobs"], env, tree)
        for argv, env, cwd in commands.values():  # warm-up: bytecode written, files in the page cache
            run(argv, env=env, cwd=cwd)
        for pycache in (base / "nopyc").rglob("__pycache__"):
            shutil.rmtree(pycache)
        arms = {
            name: (lambda _rep, a=argv, e=env, c=cwd: run(a, env=e, cwd=c))
            for name, (argv, env, cwd) in commands.items()
        }
        timings = interleaved(arms, reps)
    wall = {name: rounded(median(values)) for name, values in timings.wall.items()}
    cpu = {name: rounded(median(values)) for name, values in timings.cpu.items()}
    figures = {
        "code": args.code or "checkout",
        "against": rev,
        "site": args.site,
        "wall_median_s": wall,
        "cpu_median_s": cpu,
    }
    # The VM's speed drifts within minutes: what compares is paired (each repetition's arms ran
    # back to back), the ratio of two arms and a command's seconds above the libraries' floor.
    w = timings.wall
    figures["ratios"] = {
        "status / floor": rounded(paired_ratio(w["status"], w["floor"])),
        f"status / status@{rev}": rounded(paired_ratio(w["status"], w[f"status@{rev}"])),
        f"jobs / jobs@{rev}": rounded(paired_ratio(w["jobs"], w[f"jobs@{rev}"])),
        "status, no pyc / status": rounded(paired_ratio(w["status, no pyc"], w["status"])),
    }
    if args.site:
        figures["ratios"]["status, +site / status"] = rounded(paired_ratio(w["status, +site"], w["status"]))
    figures["above_floor_s"] = {
        name: rounded(median([a - b for a, b in zip(w[name], w["floor"], strict=True)]))
        for name in w
        if name.startswith(("status", "jobs"))
    }
    figures.update(timings.rounded())
    checks = [
        Check("`visbatch status JOB`, whole process (median wall)", wall["status"], "<=", 0.5, unit=" s"),
        Check("`visbatch jobs`, whole process (median wall)", wall["jobs"], "<=", 0.5, unit=" s"),
    ]
    for name in commands:
        above = figures["above_floor_s"].get(name)
        extra = f"  above the floor {above:+.3f} s" if above is not None else ""
        print(f"[cli_latency] {name:24} wall {wall[name]:.3f} s  cpu {cpu[name]:.3f} s{extra}")
    for name, ratio in figures["ratios"].items():
        print(f"[cli_latency] {name}: {ratio:.3f}")
    write_result(
        "cli_latency",
        quick=args.quick,
        question=__doc__.splitlines()[0],
        baseline=f"the same commands at {rev}, and the libraries' floor, in the same run",
        reps=reps,
        checks=checks,
        figures=figures,
        chart=bars(list(wall), list(wall.values()), "seconds (median wall)", "Q13b status and jobs"),
    )


if __name__ == "__main__":
    main()
