"""The load engine (capacity tests only): fixed answers the pipeline stores like any other.

The end-to-end test runs the embedded pipeline on the tiny model with VISBATCH_ENGINE=load (real
SQLite, real files, the real vision tower for encode); no time is asserted: the engine's pacing
is checked on its schedule (what it charged), never with a clock.
"""

from __future__ import annotations

import pytest
import torch

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
from tests.media import write_pdf
from worker.drivers.embedded import run_job
from worker.engines import resolve_engine_name
from worker.engines.base import EngineRequest
from worker.engines.load_engine import LoadEngine
from worker.runtime import Runtime
from worker.tokens.tensors import VisualTokens

pytestmark = pytest.mark.slow

SPEC = JobSpec(prompts=["What is on this page?", "Total?"], sampling=Sampling(max_new_tokens=5))


def _request(prompt_tokens: int, max_new_tokens: int) -> EngineRequest:
    visual = VisualTokens(embeds=torch.zeros(4, 8), grid_thw=torch.tensor([[1, 2, 2]]))
    return EngineRequest(
        prompt_ids=[1] * prompt_tokens, visual=visual, cache_key="k", max_new_tokens=max_new_tokens
    )


def test_answers_are_fixed_tokens_and_each_request_is_charged_its_tokens():
    engine = LoadEngine(7, " ok", tokens_per_s=1e9, output_tokens=3)
    out = engine.generate([_request(10, 8), _request(20, 2)])
    assert [g.token_ids for g in out] == [[7, 7, 7], [7, 7]]  # min(max_new_tokens, output_tokens)
    assert [g.text for g in out] == [" ok ok ok", " ok ok"]
    assert engine.tokens_served == (10 + 3) + (20 + 2)
    fixed = LoadEngine(7, " ok", tokens_per_s=1e9, request_tokens=1650)
    fixed.generate([_request(10, 8)])
    assert fixed.tokens_served == 1650  # a tiny model's request loads the services like a 7B's


def test_an_aborted_request_never_comes_back():
    engine = LoadEngine(7, " ok", tokens_per_s=1e9)
    engine.add("a", _request(5, 4))
    engine.add("b", _request(5, 4))
    engine.request_abort(["a"])
    finished: list[str] = []
    while engine.unfinished:
        finished += [rid for rid, _ in engine.step()]
    assert finished == ["b"]


def test_auto_never_picks_it(tiny_adapter):
    assert resolve_engine_name("auto", tiny_adapter) != "load"


def test_a_job_on_the_load_engine_is_stored_like_any_other(settings_factory, tmp_path):
    (tmp_path / "in").mkdir()
    write_pdf(tmp_path / "in" / "doc.pdf", pages=3)
    rt = Runtime(settings_factory(engine="load", load_tokens_per_s=1e7, load_output_tokens=4))
    job = run_job(rt, [tmp_path / "in"], SPEC)
    summary = repo.job_summary(rt.db, job)
    assert summary["status"] == "succeeded", summary["errors"]
    rows = list(repo.iter_results(rt.db, job))
    assert len(rows) == 3 * len(SPEC.prompts) == summary["results"]
    assert {r["text"] for r in rows} == {rt.engine.text * 4}
    assert {r["engine"] for r in rows} == {"load"}
    assert summary["completion_tokens"] == 4 * len(rows)
    rt.close()
