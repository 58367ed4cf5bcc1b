"""The stage layer: every stage of a job, once, with its bookkeeping; the drivers are thin.

  start     a job and its sources (holds on the countdown), or a stopped job reopened
  ingest    one source (or a range of its pages) -> unit rows; the units to encode next
  encode    units -> cached visual tokens; the units to generate next
  generate  a loop that keeps the engine's window full and stores results as they finish

Each stage has one shape for failure (`failures`: a name, the job of its work, and `give_up`,
which records the last failed try: the source or units fail with the real cause and the job goes
on), and one runner decides what a failed try means (`runner`: another try after a wait while the
error is transient and tries remain, else the stage gives it up; nothing while the run stops;
nothing for a job that finished meanwhile). Both drivers call the runner, so a failure means the
same in a fleet and in one process. Each stage owns its counters, holds and closing: whatever
takes a job's countdown to 0 closes it. A stage is handed the services it declares in `needs`
(a protocol per stage), never the whole runtime.

The embedded run (worker.drivers.embedded) connects the stages with bounded queues in one
process; the fleet (worker.drivers.fleet.tasks) runs the same functions in Celery tasks, like
datatrove's local and Slurm executors run the same steps. Neither ingest, nor `failures`, nor
`runner` imports torch: the ingest stage runs on CPU-only machines.
"""
