"""This run's hold on its job (storage.leases): taken before any work, renewed in a thread while
the run works, let go when it ends.

A run that finds its lease taken by another (after a pause longer than the lease: a stopped VM, a
database away that long) stops at once and writes nothing more to the job: the run that took it
over owns it now.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable

from storage.db import Database
from storage.leases import Lease, LeaseHeld, read_lease, release_lease, renew_lease, take_lease
from worker.drivers.job_activity import parse_process, run_alive, this_process, where

log = logging.getLogger(__name__)


class RunLease:
    def __init__(self, db: Database, lease_s: float, on_lost: Callable[[str], None]) -> None:
        self.db = db
        self.lease_s = lease_s
        self.on_lost = on_lost
        self.holder = uuid.uuid4().hex
        self.job_id: str | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, job_id: str) -> None:
        """Hold `job_id`, or raise LeaseHeld (touching nothing) while the run that holds it lives."""
        seen = read_lease(self.db, job_id)
        if seen.holder is not None and seen.holder != self.holder:
            refuse_if_alive(seen)
        if not take_lease(self.db, seen, self.holder, this_process(), self.lease_s):
            raise LeaseHeld(read_lease(self.db, job_id), "another process took it over just now")
        self.job_id = job_id
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.job_id is not None and not self.lost:
            with contextlib.suppress(Exception):  # unreleased, it expires on its own
                release_lease(self.db, self.job_id, self.holder)

    def _renew(self) -> None:
        # Six renewals a lease: a database away for a few seconds never lets a live run expire.
        while not self._stop.wait(self.lease_s / 6):
            assert self.job_id is not None
            try:
                held = renew_lease(self.db, self.job_id, self.holder, self.lease_s)
            except Exception as exc:  # the database is away: try again at the next tick
                log.debug("could not renew the lease on job %s: %s", self.job_id, exc)
                continue
            if not held:
                self.lost = True
                self.on_lost(f"another process took job {self.job_id} over")
                return


def refuse_if_alive(lease: Lease) -> None:
    """Raise LeaseHeld when the run that holds `lease` is alive (or cannot be told gone while its
    lease is live); return when it is gone: its process known ended here, its lease expired."""
    runner = parse_process(lease.process)
    alive = run_alive(runner, lease.view()) if runner is not None else lease.live()
    if alive is not False:
        raise LeaseHeld(lease, where(runner) if runner is not None else "in another process")
