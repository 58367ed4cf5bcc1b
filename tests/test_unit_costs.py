"""What a page costs the database, counted (issue 24): the per-message reads of the generate stage.

The fleet sends one generate message per unit. Each message used to cost three transactions of
its own before the engine saw it: the job's spec (is it still live?), the unit's row and the
answers already stored for the unit. All are now shared: the units and the answers are read once
for every message waiting in the generate service's inbox (GenerateLoop.add_many), and a generate
task reuses a live job's spec for a second. These tests count the statements with storage.usage
(SQLAlchemy engine events, what bench/unit_costs.py sums over processes) on a real SQLite
database and the tiny model.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
from storage import usage
from storage.models import UnitStatus
from tests.media import write_pdf
from worker.drivers.embedded import start_local_job
from worker.runtime import Runtime
from worker.stages.encode import encode_units
from worker.stages.generate import GenerateLoop, JobUnits, Ticket, UnitIds, UnitsOutcome
from worker.stages.ingest import ingest_source

pytestmark = pytest.mark.slow

SPEC = JobSpec(prompts=["What is on this page?", "Total?"], sampling=Sampling(max_new_tokens=3))
PAGES = 6


@pytest.fixture
def counting(monkeypatch, tmp_path):
    """storage.usage on, for databases opened from now on (as VISBATCH_USAGE_DIR does at import)."""
    monkeypatch.setattr(usage, "DIRECTORY", tmp_path / "usage")

    def statements(key: str) -> int:
        return usage.snapshot().get(key, 0)

    return statements


def _encoded_units(rt: Runtime, folder: Path):
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages=PAGES)
    job_id, sources = start_local_job(rt, [folder / "doc.pdf"], SPEC)
    for s in sources:
        ingest_source(rt, job_id, s.source_id, s.uri, Path(s.location), SPEC)
    encode_units(rt, repo.units_in_state(rt.db, job_id, UnitStatus.PENDING), SPEC)
    units = repo.units_in_state(rt.db, job_id, UnitStatus.ENCODED)
    assert len(units) == PAGES
    return job_id, units


def test_one_read_of_units_and_answers_for_every_waiting_message(counting, settings_factory, tmp_path):
    rt = Runtime(settings_factory(engine="load", load_tokens_per_s=1e7))
    job_id, units = _encoded_units(rt, tmp_path / "in")
    answers, rows = "sql.by_table.select results", "sql.by_table.select units"

    # As before the fix: one submission (a fleet message) at a time, one read of answers each.
    one_by_one = GenerateLoop(rt)
    before = counting(answers)
    for unit in units[:2]:
        one_by_one.add(JobUnits([unit], SPEC))
    assert counting(answers) - before == 2
    one_by_one.run_until_idle()

    # What the generate service now does with the messages waiting in its inbox: they name their
    # units by id, and one read of units and one of answers serve them all. The last message is
    # a redelivery of a unit already done: nothing to do, settled at once.
    batched = GenerateLoop(rt)
    messages = [UnitIds([u.unit_id], SPEC) for u in units[2:]] + [UnitIds([units[0].unit_id], SPEC)]
    tickets = [Ticket(Future(), left=1) for _ in messages]
    before = {key: counting(key) for key in (answers, rows)}
    batched.add_many(list(zip(messages, tickets, strict=True)))
    assert {key: counting(key) - before[key] for key in (answers, rows)} == {answers: 1, rows: 1}
    assert tickets[-1].future.result(timeout=0) == UnitsOutcome()
    batched.run_until_idle()
    assert [t.future.result(timeout=0) for t in tickets[:-1]] == [UnitsOutcome(stored=1)] * (PAGES - 2)

    summary = repo.job_summary(rt.db, job_id)
    assert summary["results"] == PAGES * len(SPEC.prompts)  # every unit answered, none twice
    answered = repo.answered_questions(rt.db, [u.unit_id for u in units])
    assert sorted(len(v) for v in answered.values()) == [2] * PAGES
    rt.close()


def test_a_generate_task_reads_a_live_job_once_a_second(counting, monkeypatch, settings_factory):
    import worker.drivers.fleet.tasks as tasks

    rt = Runtime(settings_factory())
    monkeypatch.setattr(tasks, "_db", lambda: rt.db)
    monkeypatch.setattr(tasks, "_RECENT_SPECS", {})
    job_id = repo.create_job(rt.db, SPEC.model_dump(mode="json"), status="running")
    reads = "sql.by_table.select jobs"

    before = counting(reads)
    specs = [tasks._recent_live_spec(job_id) for _ in range(20)]  # 20 messages of one job
    assert counting(reads) - before == 1
    assert all(s == SPEC for s in specs)

    # A finished job is never remembered: once the second is up, its messages are skipped.
    repo.set_job_status(rt.db, job_id, "cancelled")
    monkeypatch.setattr(tasks, "_SPEC_TTL_S", 0.0)
    assert tasks._recent_live_spec(job_id) is None
    assert job_id not in tasks._RECENT_SPECS
    rt.close()
