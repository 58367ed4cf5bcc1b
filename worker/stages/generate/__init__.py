"""The generate stage: keep the engine full, store each unit's results as soon as they are all in.

`GenerateLoop` (loop.py) keeps up to a window of requests in the engine, asking each unit the
prompts it has no good answer to yet, and stores a unit's results in one transaction once all are
in; its docstring says how (grouped writes, the poll that aborts a cancelled job's requests).

`GenerateService` (service.py) runs a loop (loop.py) in its own thread behind a thread-safe
inbox: the embedded run's encode thread and a fleet worker's task threads submit units and wait
(a Future) until their results are stored; Celery acknowledges a message only then.

submissions.py: what it is handed and answers; requests.py: a unit's requests, built from its
cached visual tokens, and its result rows.
"""

from worker.stages.generate.loop import FLUSH_SECONDS, FLUSH_UNITS, POLL_SECONDS, GenerateLoop
from worker.stages.generate.service import GenerateService
from worker.stages.generate.submissions import JobUnits, ServiceClosed, Ticket, UnitIds, UnitsOutcome

__all__ = [
    "FLUSH_SECONDS",
    "FLUSH_UNITS",
    "POLL_SECONDS",
    "GenerateLoop",
    "GenerateService",
    "JobUnits",
    "ServiceClosed",
    "Ticket",
    "UnitIds",
    "UnitsOutcome",
]
