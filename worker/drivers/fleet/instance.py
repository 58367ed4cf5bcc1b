"""This process's instance id: what names a fleet worker (its Celery name, its heartbeat, the
deliveries it holds on a Redis broker), since a pid and a host name are not unique in containers
(each may run its worker as pid 1 under one host name). Made once per process, and anew in a
forked child (a prefork pool's process is another holder, whose renewals must never keep its
dead parent's id alive)."""

from __future__ import annotations

import os
import uuid

_ID = uuid.uuid4().hex[:12]


def this_instance() -> str:
    """12 hex digits, random."""
    return _ID


def _new_process() -> None:
    global _ID
    _ID = uuid.uuid4().hex[:12]


os.register_at_fork(after_in_child=_new_process)
