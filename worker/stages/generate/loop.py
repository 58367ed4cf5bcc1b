"""The generate loop: keep the engine full, store each unit's results as soon as they are all in.

`GenerateLoop` is driven by one thread. Units come in a job at a time (JobUnits or UnitIds: one
spec for a submission's units); each is asked the prompts it has no good answer to yet (all of
them, unless a job is resumed or a message redelivered), all its requests added to the engine
together (vLLM's prefix cache then serves the image to every prompt after the first). The loop
keeps up to `window` requests in flight and refills as they finish, so vLLM's scheduler always
has hundreds of sequences to run instead of one small batch at a time; the transformers engine
packs what is queued into static batches.
A unit's results are stored, and the unit marked done, in one transaction (storage.results);
writes are grouped (every FLUSH_UNITS units or FLUSH_SECONDS), never per request.

Every POLL_SECONDS the jobs in flight are looked up: a job cancelled (`visbatch cancel`, or
finished for any reason) has its requests aborted in the engine at once, mid-batch included.
Nothing of a finished job is stored after that: the storing transaction reads the jobs' states
first (storage.results.store_results), so answers the engine gave between two polls are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ingest.spec import JobSpec
from storage import repository as repo
from storage.models import UnitStatus
from storage.rows import ResultRow, UnitTask, WindowTask
from storage.summaries import SourceTask
from worker import metrics
from worker.retry import describe
from worker.stages.generate.requests import Prepared, Question
from worker.stages.generate.submissions import JobUnits, Submission, Ticket, UnitIds, UnitsOutcome
from worker.stages.generate.summaries import SummaryBuilder, summary_index
from worker.stages.needs import GenerateNeeds
from worker.stages.runner import RetriesSpent

log = logging.getLogger(__name__)

FLUSH_UNITS = 32
FLUSH_SECONDS = 0.5
POLL_SECONDS = 1.0


def _key(unit: UnitTask | WindowTask | SourceTask) -> int:
    """The loop's key of a work: its unit's id; a source's summary, minus its first unit's (that
    unit, or the window it starts, may be in flight beside it)."""
    return -unit.unit_id if isinstance(unit, SourceTask) else unit.unit_id


@dataclass
class _Work:
    unit: UnitTask | WindowTask | SourceTask
    spec: JobSpec
    waiting: int
    rows: list[ResultRow] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)


class GenerateLoop:
    def __init__(
        self,
        rt: GenerateNeeds,
        *,
        window: int | None = None,
        on_jobs_stopped: Callable[[set[str]], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.rt = rt
        self.on_jobs_stopped = on_jobs_stopped
        # Set when the run is being stopped: a database retry's backoff ends at once (the units
        # stay encoded, and a resume answers them) instead of waiting out minutes of backoff.
        self.stop = stop
        self._stopped: set[str] = set()  # jobs found finished: their units are refused from now on
        self.engine = rt.engine
        self.builder = rt.requests
        self.window = window or rt.generate_window
        self._requests: dict[str, tuple[Prepared, float]] = {}  # request id -> (request, added at)
        # Request ids are never reused (unit:prompt:sequence): an abort or a late output of an
        # earlier request for the same unit (a redelivered message) can never hit the new one.
        self._sequence = itertools.count()
        self._work: dict[int, _Work] = {}  # unit id -> its requests in flight
        self._answered: list[_Work] = []  # every request answered, results not yet stored
        self._busy: dict[str, float] = defaultdict(float)  # job -> engine seconds not yet recorded
        self._flushed_at = self._polled_at = time.monotonic()
        self.results_stored = 0
        self.busy_seconds = 0.0

    @functools.cached_property
    def summaries(self) -> SummaryBuilder:
        """Builds the requests of sources' summaries (made on first use: most jobs have none)."""
        return SummaryBuilder(self.builder.adapter, context_tokens(self.builder.adapter))

    # --- taking work ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.window

    @property
    def idle(self) -> bool:
        return not self._requests and not self._answered

    def jobs(self) -> set[str]:
        return {w.unit.job_id for w in self._work.values()} | {w.unit.job_id for w in self._answered}

    def add(self, job: JobUnits, ticket: Ticket | None = None) -> None:
        """Ask each unit the prompts it has no good answer to yet; all of a unit's requests together."""
        self.add_many([(job, ticket)])

    def add_many(self, batch: list[Submission]) -> None:
        """`add` for several submissions with ONE read of their units (those named by id) and ONE
        of the answers already stored: a fleet worker gets a message per unit, and reading per
        message was two SQL transactions per page."""
        read = self._as_windows(self._read_units(batch))
        fresh = sorted({
            u.unit_id for job, _ in read for u in job.units
            if u.job_id not in self._stopped and _key(u) not in self._work
        })  # fmt: skip
        try:
            answered = (
                self.rt.retry.call(
                    lambda: repo.answered_questions(self.rt.db, fresh), what="reading answers", stop=self.stop
                )
                if fresh
                else {}
            )
        except Exception as exc:  # the database stayed away: these units are not taken
            for _, ticket in read:
                if ticket is not None:
                    ticket.fail(self._spent(exc))
            return
        for job, ticket in read:
            self._add(job, ticket, answered)

    def _read_units(self, batch: list[Submission]) -> list[tuple[JobUnits | UnitIds, Ticket | None]]:
        """The submissions with their units: those named by id read in one query, still encoded
        (a redelivered message's units already done are left out; a submission left with none is
        settled at once)."""
        # A windowed job's units are named only to find their windows (`_as_windows`), whatever
        # their state: a unit that failed settles its windows too.
        named = sorted({
            i for req, _ in batch
            if isinstance(req, UnitIds) and req.spec.window is None for i in req.unit_ids
        })  # fmt: skip
        units: dict[int, UnitTask] = {}
        error: Exception | None = None
        if named:
            try:
                read = self.rt.retry.call(
                    lambda: repo.units_by_ids(self.rt.db, named, UnitStatus.ENCODED),
                    what="reading units",
                    stop=self.stop,
                )
                units = {u.unit_id: u for u in read}
            except Exception as exc:  # the database stayed away: these submitters hear why
                error = self._spent(exc)
        out: list[tuple[JobUnits | UnitIds, Ticket | None]] = []
        for req, ticket in batch:
            if isinstance(req, JobUnits) or req.spec.window is not None:
                out.append((req, ticket))
                continue
            if error is not None:
                if ticket is not None:
                    ticket.fail(error)
                continue
            found = [units[i] for i in dict.fromkeys(req.unit_ids) if i in units]
            if ticket is not None:
                ticket.left = len(found)
                if not found and not ticket.future.done():
                    ticket.future.set_result(UnitsOutcome())
            if found:
                out.append((JobUnits(found, req.spec), ticket))
        return out

    def _as_windows(
        self, read: list[tuple[JobUnits | UnitIds, Ticket | None]]
    ) -> list[tuple[JobUnits, Ticket | None]]:
        """A windowed job's submissions as the windows their units are in that are ready to ask
        (storage.windows): a window is asked once its last unit is encoded, whichever submission
        names it; its submitter's ticket then counts windows."""
        out: list[tuple[JobUnits, Ticket | None]] = []
        for req, ticket in read:
            plan = req.spec.window_plan()
            if plan is None:
                assert isinstance(req, JobUnits)
                out.append((req, ticket))
                continue
            ids = req.unit_ids if isinstance(req, UnitIds) else [u.unit_id for u in req.units]
            try:
                windows = self.rt.retry.call(
                    lambda plan=plan, ids=ids: repo.ready_windows(self.rt.db, plan, ids),
                    what="reading windows",
                    stop=self.stop,
                )
            except Exception as exc:  # the database stayed away: this submitter hears why
                if ticket is not None:
                    ticket.fail(self._spent(exc))
                continue
            if ticket is not None:
                ticket.left = len(windows)
                if not windows and not ticket.future.done():
                    ticket.future.set_result(UnitsOutcome())
            if windows:
                out.append((JobUnits(windows, req.spec), ticket))
        return out

    def _add(
        self, job: JobUnits, ticket: Ticket | None, answered: dict[int, dict[tuple[int, int], str]]
    ) -> None:
        spec = job.spec
        refused = [u for u in job.units if u.job_id in self._stopped]
        if refused and ticket is not None:
            for _ in refused:
                ticket.settle(stored=False)
        units = [u for u in job.units if u.job_id not in self._stopped]
        fresh = [u for u in units if _key(u) not in self._work]
        for unit in units:
            if _key(unit) in self._work and ticket is not None:  # redelivered while in flight
                self._work[_key(unit)].tickets.append(ticket)
        for unit in fresh:
            questions = _questions_left(spec, answered.get(unit.unit_id, {}))
            waiting = sum(len(spec.turns(q.prompt_index)) - q.turn for q in questions)
            work = _Work(unit, spec, waiting=waiting, tickets=[ticket] if ticket else [])
            if not questions:  # every answer is stored already: only the unit's state is left
                self._answered.append(work)
                continue
            self._work[_key(unit)] = work
            for prepared in self.builder.prepare(unit, spec, questions):
                self._ask(work, prepared)

    def _ask(self, work: _Work, prepared: Prepared) -> None:
        """Give the request to the engine; one that cannot be asked is answered with why."""
        if prepared.request is None:
            self._turn_answered(work, prepared, self.builder.row(prepared, None, 0.0))
            return
        unit_id = prepared.unit.unit_id
        request_id = f"{unit_id}:{prepared.prompt_index}:{prepared.turn}:{next(self._sequence)}"
        self._requests[request_id] = (prepared, time.monotonic())
        self.engine.add(request_id, prepared.request)

    def _turn_answered(self, work: _Work, prepared: Prepared, row: ResultRow) -> None:
        """A turn's answer: the conversation's next turn is asked with it (`--then`); after a
        turn without an answer, the later turns are answered with why."""
        if prepared.chain is not None:
            self._summary_part(work, prepared, row)
            return
        self._answer(work, row)
        if prepared.last_turn:
            return
        if row.error is None and row.text is not None and prepared.request is not None:
            self._ask(work, self.builder.follow_up(prepared, row.text))
            return
        for turn in range(prepared.turn + 1, len(prepared.spec.turns(prepared.prompt_index))):
            why = f"not asked: turn {prepared.turn} has no answer ({row.error})"
            skipped = Prepared(prepared.unit, prepared.spec, prepared.prompt_index, None, why, turn)
            self._answer(work, self.builder.row(skipped, None, 0.0))

    # --- running -------------------------------------------------------------------------------

    def step(self) -> None:
        """One engine step; what finished is stored when a flush is due; cancels are looked for."""
        if self.engine.unfinished:
            jobs = {prepared.unit.job_id for prepared, _ in self._requests.values()}
            started = time.monotonic()
            try:
                finished = self.engine.step()
            except Exception as exc:  # a dead engine: every request in flight fails, the loop lives
                log.exception("the engine failed")
                finished = []
                self._fail_in_flight(f"engine failed: {describe(exc)}")
            elapsed = time.monotonic() - started
            self.busy_seconds += elapsed
            metrics.ENGINE_BUSY.inc(elapsed)
            metrics.STAGE_BUSY.labels("generate").inc(elapsed)
            for job_id in jobs:
                self._busy[job_id] += elapsed
            now = time.monotonic()
            for request_id, generation in finished:
                entry = self._requests.pop(request_id, None)
                if entry is None:
                    continue  # aborted meanwhile
                prepared, added = entry
                metrics.REQUEST_SECONDS.observe(now - added)
                work = self._work.get(_key(prepared.unit))
                if work is not None:
                    row = self.builder.row(prepared, generation, (now - added) * 1000.0)
                    self._turn_answered(work, prepared, row)
        metrics.IN_FLIGHT.set(len(self._requests))
        self._maybe_poll()
        if self._answered and (
            len(self._answered) >= FLUSH_UNITS
            or not self._requests
            or time.monotonic() - self._flushed_at >= FLUSH_SECONDS
        ):
            self.flush()

    def run_until_idle(self) -> None:
        while not self.idle:
            self.step()
        self.flush()

    def _summary_part(self, work: _Work, prepared: Prepared, row: ResultRow) -> None:
        """A source summary's request answered: the last is the summary's row; a part's answer
        waits for the stage's others, then the next stage is asked (summaries.SummaryBuilder)."""
        chain = prepared.chain
        assert chain is not None
        if chain.final or row.error is not None or row.text is None:
            if not chain.final:  # a part failed: the summary is that failure
                row = dataclasses.replace(row, error=f"a part of the summary failed: {row.error}")
            self._answer(work, row)
            return
        chain.answers[prepared.part] = row.text
        if len(chain.answers) == chain.parts:
            for nxt in self.summaries.next(chain):
                self._ask(work, nxt)

    def _summarize(self, answered: list[_Work]) -> None:
        """The sources of a job with a summary whose answers are now all in: their summaries are
        asked (a summary work per source, waiting on its last request)."""
        sources = {
            (w.unit.job_id, w.unit.source_id): w.spec
            for w in answered
            if w.spec.summarize is not None and not isinstance(w.unit, SourceTask)
        }
        for (job_id, source_id), spec in sources.items():
            if job_id in self._stopped:
                continue
            rule, questions = spec.window_plan(), len(spec.questions())
            try:
                tasks = self.rt.retry.call(
                    lambda s=source_id, r=rule, q=questions, spec=spec: repo.answered_sources(
                        self.rt.db, [(s, r, q)], summary_index(spec)
                    ),
                    what="reading a source's answers",
                    stop=self.stop,
                )
            except Exception as exc:  # the database away: a resume (or the stall watch) asks it
                log.warning(
                    "could not read the answers of source %d to summarize: %s", source_id, describe(exc)
                )
                continue
            for task in tasks:
                if _key(task) in self._work:  # asked already, in flight
                    continue
                work = _Work(task, spec, waiting=1)
                self._work[_key(task)] = work
                for prepared in self.summaries.start(task, spec):
                    self._ask(work, prepared)

    def _answer(self, work: _Work, row: ResultRow) -> None:
        work.rows.append(row)
        work.waiting -= 1
        if work.waiting == 0:
            self._work.pop(_key(work.unit), None)
            self._answered.append(work)

    def _fail_in_flight(self, message: str) -> None:
        self.engine.request_abort(list(self._requests))
        requests, self._requests = self._requests, {}
        for prepared, _ in requests.values():
            work = self._work.get(_key(prepared.unit))
            if work is not None:
                row = dataclasses.replace(self.builder.row(prepared, None, 0.0), error=message)
                self._turn_answered(work, prepared, row)

    def _spent(self, exc: Exception) -> RetriesSpent:
        """A database error this loop has retried already: its submitter gives it up, never
        retries it again (worker.stages.runner: retries never nest)."""
        return RetriesSpent(exc, self.rt.retry.tries_spent(exc))

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def flush(self) -> None:
        """Store every answered unit's results and mark it done (one transaction); record busy time."""
        answered, self._answered = self._answered, []
        self._flushed_at = time.monotonic()
        if answered:
            rows = [(w.unit.job_id, row) for w in answered for row in w.rows]
            # A job with a summary: its units are done with their source's summary (summarized).
            units = [
                (w.unit.job_id, w.unit.unit_id)
                for w in answered
                if isinstance(w.unit, UnitTask) and w.spec.summarize is None
            ]
            # A window's units are done once all their windows are answered: settled by source.
            windows = {
                (w.unit.job_id, w.unit.source_id): (w.spec.window_plan(), len(w.spec.questions()))
                for w in answered
                if isinstance(w.unit, WindowTask) and w.spec.summarize is None
            }
            summarized = [
                (w.unit.job_id, w.unit.source_id) for w in answered if isinstance(w.unit, SourceTask)
            ]
            try:
                stored = self.rt.retry.call(
                    lambda: repo.store_results(self.rt.db, rows, units, windows, summarized),
                    what="storing results",
                    stop=self.stop,
                )
                self.rt.retry.call(
                    lambda: repo.close_finished(self.rt.db, stored.remaining),
                    what="closing jobs",
                    stop=self.stop,
                )
            except Exception as exc:
                # The database stayed away through every retry: these units stay encoded, and
                # their submitters hear why, as spent (the runner gives them up, never retries
                # them again: worker.stages.runner).
                log.error("could not store the results of %d units: %s", len(answered), describe(exc))
                for work in answered:
                    for ticket in work.tickets:
                        ticket.fail(self._spent(exc))
            else:
                kept = [w for w in answered if w.unit.job_id not in stored.refused]
                # Before the tickets settle: the run that waits on them finds the summary asked.
                self._summarize(kept)
                self._forget_tokens(answered)
                self.results_stored += sum(len(w.rows) for w in kept)
                _count([(w.unit.job_id, row) for w in kept for row in w.rows], len(kept))
                for work in answered:
                    for ticket in work.tickets:
                        ticket.settle(stored=work.unit.job_id not in stored.refused)
                if stored.refused:  # stopped since the last poll: the rest of their work goes now
                    self._stop_jobs(stored.refused)
        busy, self._busy = self._busy, defaultdict(float)
        try:
            for job_id, seconds in busy.items():
                repo.add_stage_seconds(self.rt.db, job_id, "generate", seconds)
        except Exception as exc:  # a statistic: never worth failing work for
            log.warning("could not record generate time: %s", describe(exc))

    def _forget_tokens(self, answered: list[_Work]) -> None:
        """Cache policy ``none``: the entries these units' encode wrote go now their answers are
        stored (or their job stopped). An entry a unit found in the cache (another job's, or an
        identical page's) is not this unit's to delete; a failed delete is left to the TTL."""
        tokens = self.rt.token_store.for_policy("none")
        for work in answered:
            unit = work.unit
            if work.spec.cache != "none" or unit.cache_hit or not unit.cache_key:
                continue
            try:
                tokens.forget(unit.cache_key)
            except Exception as exc:  # the cache away: the entry expires on its own
                log.warning("could not delete the cached tokens of unit %d: %s", unit.unit_id, describe(exc))

    # --- stopping work -------------------------------------------------------------------------

    def _maybe_poll(self) -> None:
        if time.monotonic() - self._polled_at < POLL_SECONDS:
            return
        self._polled_at = time.monotonic()
        jobs = self.jobs()
        if not jobs:
            return
        try:
            stopped = repo.finished_among(self.rt.db, sorted(jobs))
        except Exception as exc:  # the database away: look again at the next poll
            log.warning("could not look up the jobs in flight: %s", describe(exc))
            return
        if stopped:
            self._stop_jobs(stopped)

    def _stop_jobs(self, stopped: set[str]) -> None:
        """These jobs are finished (cancelled, most often): refuse and drop their work from now on."""
        self._stopped |= stopped
        self.drop_jobs(stopped)
        if self.on_jobs_stopped is not None:
            self.on_jobs_stopped(stopped)

    def drop_jobs(self, job_ids: set[str], error: BaseException | None = None) -> int:
        """Abort these jobs' requests in the engine and forget their units; returns units dropped.

        Their submitters hear "dropped" (the job stopped: nothing more to do), or `error` (the
        work was not done and must be done elsewhere: a fleet worker shutting down requeues it).
        """
        doomed = [rid for rid, (p, _) in self._requests.items() if p.unit.job_id in job_ids]
        self.engine.request_abort(doomed)
        for request_id in doomed:
            del self._requests[request_id]
        dropped = [w for w in self._work.values() if w.unit.job_id in job_ids]
        dropped += [w for w in self._answered if w.unit.job_id in job_ids]
        self._answered = [w for w in self._answered if w.unit.job_id not in job_ids]
        for work in dropped:
            self._work.pop(_key(work.unit), None)
            for ticket in work.tickets:
                if error is not None:
                    ticket.fail(error)
                else:
                    ticket.settle(stored=False)
        if dropped:
            log.info("dropped %d units of stopped job(s) %s", len(dropped), ", ".join(sorted(job_ids)))
        return len(dropped)

    def drop_all(self, error: BaseException | None = None) -> None:
        self.drop_jobs(self.jobs(), error)


def context_tokens(adapter: object) -> int | None:
    """The language model's context in tokens, from its config (None: it does not say)."""
    config = getattr(adapter, "config", None)
    text = getattr(config, "text_config", None) or config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def _questions_left(spec: JobSpec, answered: dict[tuple[int, int], str]) -> list[Question]:
    """What a unit (or window) is still to be asked: per prompt, its first turn without a good
    answer, after the earlier turns' stored answers (a resumed conversation goes on from there)."""
    left = []
    for p in range(len(spec.prompts)):
        turns = spec.turns(p)
        first = next((t for t in range(len(turns)) if (p, t) not in answered), None)
        if first is not None:
            history = tuple((turns[t], answered[p, t]) for t in range(first))
            left.append(Question(p, first, history))
    return left


def _count(rows: list[tuple[str, ResultRow]], units: int) -> None:
    """Metrics of stored answers: outcome, tokens, errors by kind (an answer the schema refused
    has text; a request that never ran has none)."""
    metrics.UNITS.labels("generate", "ok").inc(units)
    for _, row in rows:
        metrics.RESULTS.labels("error" if row.error else "ok").inc()
        metrics.TOKENS.labels("prompt").inc(row.prompt_tokens)
        metrics.TOKENS.labels("completion").inc(row.completion_tokens)
        metrics.TOKENS.labels("visual").inc(row.visual_tokens - row.pruned_tokens - row.merged_tokens)
        if row.error:
            metrics.ERRORS.labels(
                "generate", "invalid_output" if row.text is not None else "generation"
            ).inc()
