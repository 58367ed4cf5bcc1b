"""`python -m bench.report [--quick]`: bench/results[/quick]/*.json -> benchmarks.png + summary.md.

The PNG has one panel per question (the chart spec each benchmark wrote); summary.md is the
table the README shows: every check with its figure, its target and whether it is met.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import results_dir

ORDER = [
    "pdf_pages",
    "video_frames",
    "token_cache",
    "packing",
    "fleet",
    "results_db",
    "memory",
    "scale",
    "ingest_memory",
    "image_encoding",
    "streaming",
    "vllm_window",
    "cpu_side",
]
VERDICT = {True: "met", False: "**not met**", None: "skipped"}


def load(folder: Path) -> list[dict]:
    found = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json") if p.stem in ORDER}
    return [found[name] for name in ORDER if name in found]


def figure_text(check: dict) -> str:
    if check["value"] is None:
        return "n/a"
    value = check["value"]
    shown = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return f"{shown}{check['unit']}"


def summary_table(results: list[dict]) -> str:
    rows = ["| # | question | check | figure | target | |", "|---|---|---|---|---|---|"]
    for n, result in enumerate(results, 1):
        number = ORDER.index(result["name"]) + 1 if result["name"] in ORDER else n
        for check in result["checks"]:
            target = f"{check['op']} {check['threshold']:g}{check['unit']}"
            rows.append(
                f"| {number} | {result['question']} | {check['what']} | {figure_text(check)} | {target} "
                f"| {VERDICT[check['met']]} |"
            )
    return "\n".join(rows) + "\n"


def draw(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = max(1, (len(results) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(results) :]:
        ax.axis("off")
    for ax, result in zip(axes.flat, results, strict=False):
        spec = result["chart"]
        if spec["kind"] == "bars":
            _bars(ax, spec)
        else:
            _lines(ax, spec)
        met = [c["met"] for c in result["checks"]]
        colour = "tab:green" if all(m is True for m in met) else "tab:red" if False in met else "tab:gray"
        ax.set_title(spec["title"], fontsize=10, color=colour)
    first = results[0]
    machine = first["machine"]
    fig.suptitle(
        f"visbatch benchmarks{' (quick)' if first['quick'] else ''}, {first['date'][:10]}: "
        f"{machine['cpus']}-core VM ({machine['cpu']}), no GPU. Title green: every target met; red: not",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _bars(ax, spec: dict) -> None:
    labels = spec["labels"]
    ax.bar(range(len(labels)), spec["values"], color="tab:blue")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([_wrap(label) for label in labels], fontsize=7, rotation=0)
    ax.set_ylabel(spec["ylabel"], fontsize=8)
    if spec.get("log"):
        ax.set_yscale("log")
    for i, value in enumerate(spec["values"]):
        ax.annotate(f"{value:,.3g}", (i, value), ha="center", va="bottom", fontsize=7)


def _lines(ax, spec: dict) -> None:
    for series in spec["series"]:
        ax.plot(series["x"], series["y"], marker="o", label=series["label"])
    ax.set_xlabel(spec["xlabel"], fontsize=8)
    ax.set_ylabel(spec["ylabel"], fontsize=8)
    if spec.get("log"):
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _wrap(label: str, width: int = 14) -> str:
    words, lines, line = label.split(), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join([*lines, line])


def report(quick: bool) -> None:
    folder = results_dir(quick)
    results = load(folder)
    if not results:
        print(f"no results in {folder}")
        return
    (folder / "summary.md").write_text(summary_table(results))
    draw(results, folder / "benchmarks.png")
    print(summary_table(results))
    print(f"wrote {folder / 'summary.md'} and {folder / 'benchmarks.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    report(parser.parse_args().quick)


if __name__ == "__main__":
    main()
