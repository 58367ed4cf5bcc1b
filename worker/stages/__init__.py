"""The stage layer: every stage of a job, once, with its bookkeeping; the drivers are thin.

  start     a job and its sources (holds on the countdown), or a stopped job reopened
  ingest    one source (or a range of its pages) -> unit rows; the units to encode next
  encode    units -> cached visual tokens; the units to generate next
  generate  a loop that keeps the engine's window full and stores results as they finish

Each stage has one shape: a function that runs it over its input (raising a transient error
for the driver's retry policy, worker.retry) and a `give_up` (ingest, encode, generate) that the
driver calls once the last try has failed: the source or units fail with the real cause and the
job goes on, so a failure means the same in a fleet and in one process. Each stage owns its
counters, holds and closing: whatever takes a job's countdown to 0 closes it. A stage is handed
the services it declares in `needs` (a protocol per stage), never the whole runtime.

The embedded run (worker.drivers.embedded) connects the stages with bounded queues in one
process; the fleet (worker.drivers.tasks) runs the same functions in Celery tasks, like
datatrove's local and Slurm executors run the same steps. Nothing here imports torch at module
level: the ingest stage runs on CPU-only machines.
"""
