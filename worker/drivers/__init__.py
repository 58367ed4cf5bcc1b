"""The ways a job is made and run; they transport and call the stages (worker.stages) through the
one runner (worker.stages.runner), and never decide what a failure means:

  embedded     one process: the stages joined by bounded queues (`visbatch run`, the Python API),
               holding a lease on its job (run_lease)
  fleet/       the stages as Celery tasks, `visbatch submit`, the workers' heartbeats and the
               stall watch (a stuck fleet job resumed)
  dropfolder/  jobs from an S3 drop folder (`visbatch watch`)

and job_activity: why a job does not move, for `visbatch status` (no Celery imported)."""
