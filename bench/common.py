"""What every benchmark shares: arguments, side-by-side timing, medians, checks, JSON results.

The machine is small and noisy (2 cores, other processes running), so a figure is never an
absolute time: it is a ratio or a pair measured in the same run, arms interleaved (A B, B A,
A B ...) so that a burst of noise hits both, and the median over the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"


def results_dir(quick: bool) -> Path:
    """Full runs write bench/results/, quick runs bench/results/quick/ (the README shows full runs)."""
    folder = RESULTS / "quick" if quick else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def arguments(
    description: str,
    default_reps: int = 3,
    quick_reps: int = 3,
    more: Callable[[argparse.ArgumentParser], Any] | None = None,
) -> argparse.Namespace:
    """--quick and --reps, and the benchmark's own options (`more` adds them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="smaller inputs: the whole suite in < 5 min")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per arm (median is reported)")
    if more is not None:
        more(parser)
    args = parser.parse_args()
    if args.reps is None:
        args.reps = quick_reps if args.quick else default_reps
    return args


# --- timing ---------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class Timings:
    """Wall seconds per arm per repetition, and CPU seconds (this process + its children)."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def __getitem__(self, name: str) -> list[float]:
        return self.wall[name]

    def __iter__(self):
        return iter(self.wall)

    def items(self):
        return self.wall.items()

    def rounded(self) -> dict[str, dict[str, list[float]]]:
        return {
            "wall_s": {k: [round(x, 3) for x in v] for k, v in self.wall.items()},
            "cpu_s": {k: [round(x, 3) for x in v] for k, v in self.cpu.items()},
        }


def interleaved(arms: dict[str, Callable[[int], Any]], reps: int) -> Timings:
    """Time each arm once per repetition; the order of the arms flips every repetition."""
    names = list(arms)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            before = cpu_seconds()
            elapsed, _ = timed(lambda name=name, rep=rep: arms[name](rep))
            wall[name].append(elapsed)
            cpu[name].append(cpu_seconds() - before)
    return Timings(wall, cpu)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median of per-repetition ratios: each pair ran back to back, under the same noise."""
    return median([a / b for a, b in zip(numerator, denominator, strict=True) if b > 0])


def run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a command, failing loudly with its stderr."""
    done = subprocess.run(list(argv), capture_output=True, check=False, **kwargs)
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace") if isinstance(done.stderr, bytes) else done.stderr
        raise RuntimeError(f"{' '.join(map(str, argv))} exited {done.returncode}: {err[-2000:]}")
    return done


def tool(name: str) -> str | None:
    """Path of a baseline tool, or None (the benchmark then records why its baseline is skipped)."""
    return shutil.which(name)


# --- results --------------------------------------------------------------------------------


@dataclass
class Check:
    """One target: `value` compared with `threshold` (`>=` or `<=`); None when it could not run."""

    what: str
    value: float | None
    op: str
    threshold: float
    unit: str = "x"
    note: str = ""
    met: bool | None = field(default=None)

    def __post_init__(self) -> None:
        if self.value is not None and self.met is None:
            self.met = self.value >= self.threshold if self.op == ">=" else self.value <= self.threshold


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        import psutil

        memory = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "cpus": os.cpu_count(),
        "cpu": model,
        "memory_gib": memory,
        "gpu": None,
        "python": platform.python_version(),
        "system": platform.platform(terse=True),
    }


def _git(*args: str) -> str:
    """Read-only git query about the code measured ('' outside a checkout)."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def write_result(
    name: str,
    *,
    quick: bool,
    question: str,
    baseline: str,
    reps: int,
    checks: list[Check],
    figures: dict[str, Any],
    chart: dict[str, Any],
    notes: list[str] | None = None,
) -> Path:
    """bench/results[/quick]/<name>.json; prints a one-line verdict per check."""
    payload = {
        "name": name,
        "question": question,
        "baseline": baseline,
        "quick": quick,
        "reps": reps,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "checks": [asdict(c) for c in checks],
        "figures": figures,
        "chart": chart,
        "notes": notes or [],
    }
    path = results_dir(quick) / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    for c in checks:
        verdict = {True: "MET", False: "NOT MET", None: "SKIPPED"}[c.met]
        shown = "n/a" if c.value is None else f"{c.value:.3g}{c.unit}"
        print(f"[{name}] {c.what}: {shown} (target {c.op} {c.threshold:g}{c.unit}) {verdict}")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def rounded(value: float, digits: int = 3) -> float:
    return float(f"{value:.{digits}g}")


def bars(labels: list[str], values: list[float], ylabel: str, title: str, **extra: Any) -> dict[str, Any]:
    """Chart spec of a bar panel (drawn by bench/report.py)."""
    return {"kind": "bars", "labels": labels, "values": values, "ylabel": ylabel, "title": title, **extra}


def lines(series: list[dict[str, Any]], xlabel: str, ylabel: str, title: str, **extra: Any) -> dict[str, Any]:
    """Chart spec of a line panel; each series is {"label", "x", "y"}."""
    return {"kind": "lines", "series": series, "xlabel": xlabel, "ylabel": ylabel, "title": title, **extra}
