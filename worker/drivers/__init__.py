"""The ways a job is made and run; they transport, retry and call the stages (worker.stages),
never decide what a failure means:

  embedded    one process: the stages joined by bounded queues (`visbatch run`, the Python API)
  tasks       the fleet: the stages as Celery tasks (celery_app, broker_redis, supervisor)
  submit      a job for the fleet (`visbatch submit`), with its queue checks (consumers)
  dropfolder  jobs from an S3 drop folder (`visbatch watch`: drop_guard, drop_keys)

and what watches jobs as they run: stall_watch (the fleet resumes a stuck job) and
job_activity (why a job does not move, for `visbatch status`)."""
