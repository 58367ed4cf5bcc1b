"""What a job and a fleet will cost before anything runs: `visbatch plan` (planner.py), the fleet
and cache sizes it prints (fleet_sizing.py), and the hot-tier check a worker makes at start
(cache_check.py). Arithmetic over the model's files and the inputs: no torch, no services."""
