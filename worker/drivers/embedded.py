"""The embedded run: every stage of a job at once in this process, connected by bounded queues.

  ingest threads (VISBATCH_INGEST_WORKERS, one splitting child each)
      --units, in small chunks--> encode thread (batches of VISBATCH_ENCODE_BATCH_IMAGES, or
      fewer after ENCODE_WAIT_S) --encoded units--> generate service (a window of requests in
      the engine, results stored as each unit completes)

A page can reach its answer while later pages still render, and the GPU never waits for the
CPU to finish a source. The queues are bounded, so memory stays flat whatever the job's size:
when generation is the slowest stage the encoder waits, then ingest does. The stages are those
of the fleet (worker.stages); this module only connects them.

A stop (SIGINT/SIGTERM, see `stop`) aborts what is in flight at once and ends the job
`cancelled` with the reason; everything stored stays, and `visbatch resume` continues it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ingest.spec import JobSpec
from ingest.stage import expand_paths
from ingest.units import UnitSelection
from storage import repository as repo
from storage.leases import end_held
from storage.models import FINISHED_JOB_STATUSES, UnitStatus
from storage.rows import UnitTask
from worker.drivers.run_lease import RunLease
from worker.retry import describe
from worker.runtime import Runtime
from worker.stages.encode import encode_units
from worker.stages.failures import ENCODE, GENERATE, INGEST, SourceWork
from worker.stages.generate import GenerateService, JobUnits, UnitIds
from worker.stages.ingest import IngestStep, ingest_source, local_copy
from worker.stages.runner import Retry, Stage, Stopped, UnitsWork, after_failure, run_tries
from worker.stages.start import SourceInput, SourceToIngest, reopen_job, start_job
from worker.stages.window_checks import refuse_misfit_window

log = logging.getLogger(__name__)

W = TypeVar("W")
T = TypeVar("T")

ENCODE_WAIT_S = 0.05  # an encode batch waits at most this long to fill
QUEUE_UNITS = 256  # units waiting between two stages, at most (bounds memory)
CANCEL_POLL_S = 1.0  # how often a run looks whether `visbatch cancel` stopped its job


class Progress(Protocol):
    def update(self, stage: str, done: int, total: int | None = None) -> None: ...

    def note(self, message: str) -> None: ...


class NullProgress:
    def update(self, stage: str, done: int, total: int | None = None) -> None:
        pass

    def note(self, message: str) -> None:
        log.info(message)


@dataclass
class _Counts:
    sources_done: int = 0
    split: int = 0  # pages and frames this run rendered or decoded and stored
    units: int = 0
    encoded: int = 0
    answered_units: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def local_inputs(paths: list[Path]) -> list[SourceInput]:
    """Files as given, folders walked; a path that does not exist is a failed source."""
    return [
        SourceInput(str(p), str(p) if p.exists() else None, None if p.exists() else "file not found")
        for p in expand_paths(paths)
    ]


def start_local_job(rt: Runtime, paths: list[Path], spec: JobSpec) -> tuple[str, list[SourceToIngest]]:
    files = expand_paths(paths)
    refuse_misfit_window(spec, files, rt.model_name, rt.settings)
    return start_job(rt, spec, local_inputs(files))


class EmbeddedRun:
    """Runs one job's remaining work in this process (a new job, or a reopened one)."""

    def __init__(
        self, rt: Runtime, progress: Progress | None = None, stop: threading.Event | None = None
    ) -> None:
        self.rt = rt
        self.progress = progress or NullProgress()
        self.stop = stop or threading.Event()
        self.stop_reason: str | None = None
        self._counts = _Counts()
        self._failure: BaseException | None = None
        self._depths: dict[str, Callable[[], int]] = {}
        self.answers = 0  # answers this run stored
        self.job_id: str | None = None  # once known: a second Ctrl-C still names it
        # Held from before any work to after the job's last write (worker.drivers.run_lease).
        self.lease = RunLease(rt.db, rt.settings.lease_s, on_lost=self.request_stop)

    # --- entry points ----------------------------------------------------------------------------

    def run(self, paths: list[Path], spec: JobSpec, on_job: Callable[[str], None] | None = None) -> str:
        """Create a job for `paths` and run it; `on_job` hears its id before any work starts."""
        job_id, sources = start_local_job(self.rt, paths, spec)
        self.lease.take(job_id)
        self.job_id = job_id
        if on_job is not None:
            on_job(job_id)
        self._execute_held(job_id, spec, sources)
        return job_id

    def resume(self, job_id: str, on_job: Callable[[str], None] | None = None) -> str:
        """Continue a stopped job. A job whose run is alive (its lease is live: in another
        terminal, container or host) is refused with LeaseHeld before anything is touched."""
        full_id = repo.resolve_job_id(self.rt.db, job_id)
        self.lease.take(full_id)
        try:
            reopened, spec = reopen_job(self.rt, full_id)
        except BaseException:
            self.lease.release()
            raise
        self.job_id = full_id
        if on_job is not None:
            on_job(full_id)
        sources = [SourceToIngest(sid, uri, uri) for sid, uri in reopened.sources]
        pending = repo.units_in_state(self.rt.db, full_id, UnitStatus.PENDING)
        encoded = repo.units_in_state(self.rt.db, full_id, UnitStatus.ENCODED)
        with self._counts.lock:  # progress reads `sources 3/3`, not `sources 0/0`
            self._counts.sources_done = repo.count_sources(self.rt.db, full_id) - len(sources)
        self._execute_held(full_id, spec, sources, pending=pending, encoded=encoded)
        return full_id

    def _execute_held(self, job_id: str, spec: JobSpec, sources: list[SourceToIngest], **kw: Any) -> None:
        """`execute` under the lease taken for it, let go however the run ends."""
        try:
            with self._stopped_when_cancelled(job_id):
                self.execute(job_id, spec, sources, **kw)
        finally:
            self.lease.release()

    @contextlib.contextmanager
    def _stopped_when_cancelled(self, job_id: str) -> Iterator[None]:
        """`visbatch cancel JOB` from another terminal stops this run, whatever it is doing, be it
        the command's or the Python API's.

        The generate loop looks at its jobs only while it has requests in flight: a run that is
        splitting, loading the model or encoding (its first answers can be a batch or more away)
        went on until then, and one more vision-tower batch. Here the job's row is read every
        CANCEL_POLL_S from the start; a cancel then stops the run as Ctrl-C does, within the poll
        and the batch in flight. Only `cancelled` counts: the run's own end (succeeded, partial,
        failed) is no stop."""
        ended = threading.Event()

        def watch() -> None:
            while not ended.wait(CANCEL_POLL_S):
                if self.stop.is_set():
                    continue
                try:
                    state = repo.job_state(self.rt.db, job_id)
                except Exception:  # noqa: BLE001 - the database away: the run says so itself; look again
                    continue
                if state is not None and state[0] == "cancelled" and not ended.is_set():
                    self.request_stop("cancelled from another process")

        watcher = threading.Thread(target=watch, name="cancel-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            ended.set()
            watcher.join(timeout=CANCEL_POLL_S + 5)

    def request_stop(self, reason: str) -> None:
        """Stop as soon as possible (any thread, e.g. a signal handler); the job ends cancelled."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stop.set()

    # --- the run ---------------------------------------------------------------------------------

    def execute(
        self,
        job_id: str,
        spec: JobSpec,
        sources: list[SourceToIngest],
        *,
        pending: list[UnitTask] | None = None,
        encoded: list[UnitTask] | None = None,
    ) -> None:
        rt = self.rt
        self.job_id = job_id
        generate = GenerateService(
            rt,
            max_waiting_units=QUEUE_UNITS,
            # `visbatch cancel` from another terminal: the whole run stops, not only generation.
            on_jobs_stopped=lambda _: self.request_stop("cancelled from another process"),
        )
        to_encode: queue.Queue[list[UnitTask] | None] = queue.Queue(maxsize=max(1, QUEUE_UNITS // 8))
        self._depths = {"encode": to_encode.qsize, "generate": generate.waiting}
        waits: list[Future] = []
        watcher = threading.Thread(target=self._watch_stop, args=(generate,), name="stop", daemon=True)
        watcher.start()
        # Weights load beside ingest: the first page finds the model ready.
        threading.Thread(target=self._guard, args=(rt.warm_up,), name="warm-up", daemon=True).start()
        encoder = threading.Thread(
            target=self._guard, args=(self._encode_loop, spec, to_encode, generate, waits), name="encode"
        )
        encoder.start()
        # A resumed job's units stored by the run before count in the totals: progress then
        # reads `encoded 8/8`, not `encoded 8/0`.
        with self._counts.lock:
            self._counts.units += len(pending or []) + len(encoded or [])
            self._counts.encoded += len(encoded or [])
        try:
            if encoded:
                self._submit(generate, JobUnits(encoded, spec), waits)
            for start in range(0, len(pending or []), 64):
                self._put(to_encode, (pending or [])[start : start + 64])
            self._ingest_all(job_id, spec, sources, to_encode, generate, waits)
        except Stopped:
            pass
        except BaseException as exc:
            self._failure = self._failure or exc
            self.stop.set()
        finally:
            if not self.stop.is_set():
                to_encode.put(None)  # the encoder ends after the last batch (it also ends on a stop)
            encoder.join()
            self._wait_all(waits)
            generate.wait_idle(self.stop)  # the summaries the last answers started
            generate.close()
            rt.close_splitters()
            self.stop.set()  # releases the watcher
        self.answers = generate.loop.results_stored
        self._finish(job_id, generate)

    def queue_depths(self) -> dict[str, int]:
        """Items waiting between the stages (chunks of units for encode, submissions for generate)."""
        return {stage: depth() for stage, depth in self._depths.items()}

    def work_done(self) -> dict[str, int]:
        """What this run did (a resumed job shows that nothing was done twice)."""
        return {
            "split": self._counts.split,
            "tower_images": self.rt.images_encoded(),
            "answers": self.answers,
        }

    def _ingest_all(
        self,
        job_id: str,
        spec: JobSpec,
        sources: list[SourceToIngest],
        to_encode: queue.Queue,
        generate: GenerateService,
        waits: list[Future],
    ) -> None:
        before = self._counts.sources_done  # a resumed job's sources done by the run before
        self.progress.update("sources", before, before + len(sources))

        def one(source: SourceToIngest) -> None:
            if self.stop.is_set():
                return

            def on_units(units: list[UnitTask]) -> None:
                with self._counts.lock:
                    self._counts.units += len(units)
                self.progress.update("units", self._counts.units)
                with contextlib.suppress(Stopped):  # stored and pending: a resumed job encodes them
                    self._put(to_encode, units)

            def ingest() -> IngestStep:
                # A resumed source, or a try after a failed one (a full disk), renders only the
                # pages it does not have yet (a new source has none: one small read).
                skip = frozenset(repo.stored_unit_indexes(self.rt.db, source.source_id))
                with local_copy(self.rt, source.location) as path:
                    return ingest_source(
                        self.rt, job_id, source.source_id, source.uri, path, spec,
                        selection=UnitSelection(skip=skip), on_units=on_units, stop=self.stop,
                    )  # fmt: skip

            work = SourceWork(job_id, source.source_id, source.location)
            # Given up (None): the source failed with its cause, the job goes on.
            step = self._tries(INGEST, work, ingest) or IngestStep()
            if spec.window is not None and step.completed:
                # The source's last windows are known now; those ready are asked (the rest as
                # their units are encoded).
                ids = repo.source_unit_ids(self.rt.db, source.source_id)
                self._submit(generate, UnitIds(ids, spec), waits)
            with self._counts.lock:
                self._counts.sources_done += 1
                self._counts.split += step.units_stored
            self.progress.update("sources", self._counts.sources_done, before + len(sources))

        workers = max(1, min(self.rt.settings.ingest_workers, len(sources) or 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ingest") as pool:
            for future in [pool.submit(self._guard, one, source) for source in sources]:
                future.result()
        if self._failure is not None:
            raise self._failure
        # Every source is split: the pages+frames count is a total now (the bar was `60/?`).
        self.progress.update("units", self._counts.units, self._counts.units)

    def _encode_loop(
        self, spec: JobSpec, to_encode: queue.Queue, generate: GenerateService, waits: list[Future]
    ) -> None:
        batch_size = self.rt.settings.encode_batch_images
        ended = False
        while not ended and not self.stop.is_set():
            batch: list[UnitTask] = []
            try:
                item = to_encode.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                break
            batch.extend(item)
            deadline = time.monotonic() + ENCODE_WAIT_S
            while len(batch) < batch_size:
                try:
                    more = to_encode.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    ended = True
                    break
                batch.extend(more)
            for start in range(0, len(batch), batch_size):
                self._encode_batch(batch[start : start + batch_size], spec, generate, waits)

    def _encode_batch(
        self, units: list[UnitTask], spec: JobSpec, generate: GenerateService, waits: list[Future]
    ) -> None:
        if self.stop.is_set():
            return
        work = UnitsWork(units[0].job_id, [u.unit_id for u in units])
        try:
            step = self._tries(ENCODE, work, lambda: encode_units(self.rt, units, spec))
        except Stopped:
            return
        if step is not None:  # None: given up, the units failed with their cause
            with self._counts.lock:
                self._counts.encoded += len(units)
            self.progress.update("encode", self._counts.encoded, self._counts.units)
        if spec.window is not None:
            # Their windows, failed units' too (such a window's answer is the failure).
            self._submit(generate, UnitIds([u.unit_id for u in units], spec), waits)
        elif step is not None and step.encoded:
            self._submit(generate, JobUnits(step.encoded, spec), waits)

    def _submit(self, generate: GenerateService, units: JobUnits | UnitIds, waits: list[Future]) -> None:
        """Hand encoded units to generation: units this run encoded, and those a resumed job had
        encoded. What `waits` holds ends once they are answered, given up, or the run stops."""
        settled: Future = Future()
        waits.append(settled)
        self._try_generate(generate, units, settled, 1)

    def _try_generate(
        self, generate: GenerateService, units: JobUnits | UnitIds, settled: Future, tries: int
    ) -> None:
        """One try of generation; the runner decides what its failure means (a retry after a wait,
        from a timer: the callback runs in the generate service's thread, which must not wait)."""
        if isinstance(units, UnitIds):  # a windowed job's units, named to find their windows
            work = UnitsWork(self.job_id or "", units.unit_ids)
        else:
            work = UnitsWork(units.units[0].job_id, [u.unit_id for u in units.units])

        def done(future: Future) -> None:
            error = None if future.cancelled() else future.exception()
            if error is None:
                if not future.cancelled():
                    with self._counts.lock:
                        self._counts.answered_units += future.result().stored
                    # A windowed job counts windows answered (how many there are is known late).
                    total = None if units.spec.window is not None else self._counts.units
                    self.progress.update("generate", self._counts.answered_units, total)
                settled.set_result(None)
                return
            try:
                decision = after_failure(
                    GENERATE, work, error, tries=tries, policy=self.rt.retry, db=self.rt.db, stop=self.stop
                )
            except Stopped:
                decision = None
            except Exception as exc:  # the database cannot take even the failure: the run stops
                self._failure = self._failure or exc
                self.stop.set()
                decision = None
            if isinstance(decision, Retry):
                again = threading.Timer(
                    decision.wait, self._try_generate, (generate, units, settled, tries + 1)
                )
                again.daemon = True
                again.start()
                return
            settled.set_result(None)

        generate.submit(units).add_done_callback(done)

    def _tries(self, stage: Stage[W], work: W, body: Callable[[], T]) -> T | None:
        """`body` tried under the one runner in this thread (worker.stages.runner): its value, or None
        once given up; raises Stopped when the run stops."""
        return run_tries(stage, work, body, policy=self.rt.retry, db=self.rt.db, stop=self.stop)

    # --- plumbing --------------------------------------------------------------------------------

    def _guard(self, fn: Callable, *args: object) -> None:
        """Run a stage's thread body; its first unexpected error stops the run and fails the job."""
        try:
            fn(*args)
        except Stopped:
            pass
        except BaseException as exc:
            if not self.stop.is_set():
                log.exception("%s failed", threading.current_thread().name)
                self._failure = self._failure or exc
                self.stop.set()

    def _put(self, q: queue.Queue, item: list[UnitTask]) -> None:
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _wait_all(self, waits: list[Future]) -> None:
        """Until every submission is stored (the encoder has ended: `waits` is complete), or a stop."""
        for future in waits:
            while not self.stop.is_set():
                try:
                    future.result(timeout=0.2)
                    break
                except FutureTimeout:
                    continue
                except Exception:  # noqa: S112 - the service's error is reported by _finish
                    break

    def _watch_stop(self, generate: GenerateService) -> None:
        """On a stop, abort the engine's requests and kill the splitting children at once."""
        self.stop.wait()
        if self.stop_reason is not None or self._failure is not None:
            generate.abort_all()
            self.rt.kill_splitters()

    def _finish(self, job_id: str, generate: GenerateService) -> None:
        if self.lease.lost:  # another run holds the job now: its status is that run's to write
            return
        state = repo.job_state(self.rt.db, job_id)
        status = state[0] if state else None
        failure = self._failure or generate.error
        if failure is not None and status not in FINISHED_JOB_STATUSES:
            message = f"{describe(failure)} (visbatch resume continues it)"
            end_held(self.rt.db, job_id, self.lease.holder, "failed", message)
            return
        if self.stop_reason is not None and status not in FINISHED_JOB_STATUSES:
            message = f"{self.stop_reason}; finished work is kept"
            end_held(self.rt.db, job_id, self.lease.holder, "cancelled", message)
            return
        if status not in FINISHED_JOB_STATUSES:
            # Every stage ran to its end; the countdown closes the job, this only repairs one
            # that a lost update left open.
            repo.close_job(self.rt.db, job_id)


def run_job(rt: Runtime, paths: list[Path], spec: JobSpec, progress: Progress | None = None) -> str:
    """Run a whole job in this process; returns its id once it has ended (the Python entry point)."""
    return EmbeddedRun(rt, progress).run(paths, spec)


def ingest_only(rt: Runtime, paths: list[Path], spec: JobSpec) -> str:
    """A new job's ingest stage alone, source after source (tests and benchmarks of ingest): its
    units are stored, nothing is encoded. Returns the job id (the job stays running)."""
    job_id, sources = start_local_job(rt, paths, spec)
    for source in sources:
        ingest_source(rt, job_id, source.source_id, source.uri, Path(source.location), spec)
    return job_id
