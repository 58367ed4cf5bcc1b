"""visbatch from Python: run a job in this process or submit it to the fleet, then read its answers.

    import visbatch

    job = visbatch.run(["scans/"], prompts=["What is the invoice total?"], max_new_tokens=64)
    job.status                  # 'succeeded', 'partial', 'failed' or 'cancelled'
    for answer in job.results():
        print(answer["source"], answer["page_number"], answer["prompt"], answer["text"])
    df = job.to_pandas()        # one row per page/frame x prompt (needs pandas)

    job = visbatch.submit(["s3://bucket/inbox/"], prompts=["..."])   # Celery workers do the work
    job.wait()

Settings (database, store, cache, model) come from ``VISBATCH_*`` as everywhere (visbatch.settings).
Importing this package is light: it loads visbatch.api (and with it no torch) on first use, so that
``visbatch.settings``, which every layer reads, costs nothing more than itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from visbatch.api import Error, Job, NoWorkerWarning, Unavailable, job, jobs, run, submit

__all__ = ["Error", "Job", "NoWorkerWarning", "Unavailable", "job", "jobs", "run", "submit"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("visbatch.api"), name)
    raise AttributeError(f"module 'visbatch' has no attribute {name!r}")
