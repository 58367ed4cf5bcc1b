"""The fleet: the stages as Celery tasks on RabbitMQ or Redis.

celery_app     the app (one queue per stage, JSON only, settings from incidents)
queues         the queues and task names, which broker a URL names (no Celery imported)
tasks          one task per stage, each delivery one try under the stages' runner
broker_redis   the Redis transport: survives a broker restart, hands a dead worker's messages back
instance       this worker process's id (its name, heartbeat and deliveries)
heartbeats     each worker's heartbeat entry (`visbatch workers`, the queue checks)
consumers      which queues have workers and messages (`submit`'s warning, `status`)
stall_watch    the net behind lost messages: a stuck job resumed (registered at worker start)
supervisor     restarts a worker process that died of a broker crash path
submit         a job for the fleet (`visbatch submit`)
reconnect_logs a broker reconnect as one log line
"""
