"""Answers become result rows that every database takes: model output is untrusted bytes."""

from __future__ import annotations

import torch

from ingest.spec import JobSpec
from storage import repository as repo
from storage.rows import UnitRow, UnitTask
from worker.engines.base import EngineRequest, Generation
from worker.stages.generate.requests import Prepared, RequestBuilder, without_nul
from worker.tokens.tensors import VisualTokens

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _builder() -> RequestBuilder:
    # row() needs neither the model nor the cache: only the names it records.
    return RequestBuilder(None, None, model_name="tiny", engine_name="transformers")  # type: ignore[arg-type]


def test_nul_in_an_answer_is_stored_on_postgres_and_sqlite(db):
    job_id = repo.create_job(db, {"prompts": ["p"]})
    source_id = repo.add_source(db, job_id, "file:///a.pdf")
    [unit_id] = repo.add_units(db, job_id, source_id, [UnitRow(0, 28, 28, "images/x.png", 1)])
    unit = UnitTask(unit_id, job_id, source_id, "file:///a.pdf", "pdf", 0, "images/x.png", 1, 28, 28,
                    "k", False, None)  # fmt: skip
    visual = VisualTokens(torch.zeros(1, 4), torch.tensor([[1, 2, 2]]))
    spec = JobSpec(prompts=["p"], json_schema=SCHEMA)
    request = EngineRequest(prompt_ids=[1, 2, 3], visual=visual, cache_key="k", max_new_tokens=8)
    answer = Generation(token_ids=[1], text='{"name": "a\\u0000b\x00"}', finish_reason="stop")
    row = _builder().row(Prepared(unit, spec, 0, request), answer, 1.0)
    assert row.error is None and row.output == {"name": "a\ufffdb\ufffd"} and "\x00" not in row.text
    repo.upsert_results(db, job_id, [row])
    [stored] = list(repo.iter_results(db, job_id))
    assert stored["output"] == {"name": "a\ufffdb\ufffd"}


def test_without_nul_walks_json():
    assert without_nul({"a\x00": ["x\x00", 1, None]}) == {"a\ufffd": ["x\ufffd", 1, None]}
