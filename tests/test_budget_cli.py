"""The budget on the command line: `run --detail/--prune-keep/--merge-keep`, and tokens spent and
saved in `status` and `results`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.media import write_pdf, write_video
from worker.cli.main import app

pytestmark = pytest.mark.slow


def test_run_with_a_budget_reports_tokens_saved(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VISBATCH_MODEL", str(tiny_model_dir))
    (tmp_path / "in").mkdir()
    write_pdf(tmp_path / "in" / "doc.pdf", pages=1)
    write_video(tmp_path / "in" / "clip.mp4", seconds=2)
    runner = CliRunner()
    args = ["run", str(tmp_path / "in"), "-p", "Read the total.", "--max-new-tokens", "3"]
    budget = ["--detail", "low", "--prune-keep", "0.5", "--merge-keep", "0.5"]
    done = runner.invoke(app, [*args, *budget], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    job = done.stdout.strip().splitlines()[-1]
    status = json.loads(runner.invoke(app, ["status", job, "--json"]).stdout)
    assert status["spec"]["budget"]["detail"] == "low" and status["spec"]["budget"]["prune_keep"] == 0.5
    assert status["spec"]["budget"]["merge_keep"] == 0.5
    tokens = status["tokens"]
    assert tokens["saved"]["detail"] > 0  # the 1288-px page at 256 tokens instead of 1518
    saved = tokens["saved"]["pruning"] + tokens["saved"]["merging"]
    assert saved == tokens["spent"]["visual"] - tokens["spent"]["visual_to_lm"]
    assert tokens["saved"]["pruning"] > 0 and tokens["saved"]["merging"] > 0
    assert tokens["without_budget"] == tokens["spent"]["visual"] + tokens["saved"]["detail"]
    table = runner.invoke(app, ["status", job])
    assert "tokens saved" in table.output and "pruning" in table.output and "merging" in table.output
    results = runner.invoke(app, ["results", job])
    records = [json.loads(line) for line in results.stdout.splitlines()]
    assert all(0 < r["pruned_tokens"] < r["visual_tokens"] for r in records)
    # Merged to half first (a grid row never merges below one token), then half of that pruned.
    assert all(r["merged_tokens"] >= r["visual_tokens"] // 2 - 1 for r in records)
    assert all(r["visual_tokens"] - r["merged_tokens"] - r["pruned_tokens"] > 0 for r in records)
    assert "tokens saved" in results.stderr

    bad = runner.invoke(app, [*args, "--detail", "ultra"])
    assert bad.exit_code == 2 and "detail" in bad.output
