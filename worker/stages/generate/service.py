"""The generate service: a GenerateLoop in its own thread behind a thread-safe inbox. The embedded
run's encode thread and a fleet worker's task threads submit units and wait (a Future) until their
results are stored; Celery acknowledges a message only then."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from worker.stages.generate.loop import GenerateLoop
from worker.stages.generate.submissions import JobUnits, ServiceClosed, Ticket, UnitIds, UnitsOutcome
from worker.stages.needs import GenerateNeeds

log = logging.getLogger(__name__)


def _requests(job: JobUnits | UnitIds) -> int:
    """Requests a submission adds to the engine at most (a unit's prompts and their turns)."""
    return job.size * len(job.spec.questions())


class GenerateService:
    """A GenerateLoop in its own thread, fed through a thread-safe inbox."""

    def __init__(
        self,
        rt: GenerateNeeds,
        *,
        window: int | None = None,
        max_waiting_units: int | None = None,
        on_jobs_stopped: Callable[[set[str]], None] | None = None,
    ) -> None:
        self._aborted = threading.Event()  # from now on, everything is dropped
        self.loop = GenerateLoop(rt, window=window, on_jobs_stopped=on_jobs_stopped, stop=self._aborted)
        self._inbox: queue.Queue[tuple[JobUnits | UnitIds, Ticket]] = queue.Queue()
        # Backpressure for the embedded run: submit blocks while this many units wait in the inbox.
        self._room = threading.BoundedSemaphore(max_waiting_units) if max_waiting_units else None
        self._closing = threading.Event()
        # Taken to put into the inbox and, by the service thread, to mark it drained for good: a
        # submission can never land after the last drain, where no one would ever answer it (its
        # task thread would wait forever, and a warm-stopping worker with it).
        self._gate = threading.Lock()
        self._drained = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="generate", daemon=True)
        self._thread.start()

    def submit(self, job: JobUnits | UnitIds) -> Future:
        """One job's units to answer, or their ids (read with the batch they arrive in, those still
        encoded); the Future gives a UnitsOutcome once all are stored (or dropped)."""
        future: Future = Future()
        size = job.size
        if not size:
            future.set_result(UnitsOutcome())
            return future
        if self._aborted.is_set():
            future.set_result(UnitsOutcome(dropped=size))
            return future
        if self._closing.is_set():
            future.set_exception(ServiceClosed("the generate service is closed"))
            return future
        if self._room is not None:
            while not self._room.acquire(timeout=0.2):
                if self._closing.is_set():
                    future.set_exception(ServiceClosed("the generate service is closed"))
                    return future
        with self._gate:
            if self._drained:
                if self._room is not None:
                    self._room.release()
                future.set_exception(self.error or ServiceClosed("the generate service stopped"))
                return future
            self._inbox.put((job, Ticket(future, left=size)))
        return future

    def _take(self, timeout: float) -> bool:
        """The submissions waiting in the inbox that fit the window (at least one), handed to the
        loop together: one read of stored answers for all of them (loop.add_many)."""
        try:
            batch = [self._inbox.get(timeout=timeout)]
        except queue.Empty:
            return False
        room = self.loop.window - self.loop.in_flight - _requests(batch[0][0])
        while room > 0:
            try:
                batch.append(self._inbox.get_nowait())
            except queue.Empty:
                break
            room -= _requests(batch[-1][0])
        if self._room is not None:
            for _ in batch:
                self._room.release()
        if self._aborted.is_set():
            for job, ticket in batch:
                ticket.future.set_result(UnitsOutcome(dropped=job.size))
        else:
            self.loop.add_many(batch)
        return True

    def _run(self) -> None:
        loop = self.loop
        try:
            while not self._closing.is_set():
                if self._aborted.is_set() and not loop.idle:
                    loop.drop_all()
                while loop.has_room and self._take(0 if not loop.idle else 0.05):
                    pass
                loop.step()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter and to the driver
            log.exception("generate service failed")
            self.error = exc
            self._closing.set()  # no more submissions: a new service takes over (worker.drivers.fleet.tasks)
        finally:
            # What was not stored must be done elsewhere: its submitters hear why.
            loop.drop_all(self.error or ServiceClosed("the generate service stopped"))
            with self._gate:
                self._drained = True
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        while True:
            try:
                _, ticket = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not ticket.future.done():
                ticket.future.set_exception(self.error or ServiceClosed("the generate service stopped"))

    def abort_all(self) -> None:
        """Stop every request in flight now and drop all work from here on (from any thread): the
        run is being stopped. A transformers batch stops at its next decode step."""
        self._aborted.set()
        self.loop.engine.request_abort(self.loop.request_ids())

    def wait_idle(self, stop: threading.Event) -> None:
        """Until the loop has nothing left, not even work it started on its own (a source's
        summary), or `stop` is set, or the service ended."""
        while not stop.is_set() and self.alive:
            if self.loop.idle and self._inbox.empty():
                return
            stop.wait(0.05)

    def waiting(self) -> int:
        """Submissions waiting for room in the engine's window."""
        return self._inbox.qsize()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing.is_set()

    def close(self, timeout: float | None = None) -> None:
        self._closing.set()
        self._thread.join(timeout)
