"""The command line (`visbatch ...`, typer): main.py declares the commands, one module per command
family (run/submit/resume, ingest, plan, purge, review) holds their bodies, output.py and
inputs.py what they print and read, exits.py the exit codes, job_options.py the job options as
typer options. It sits on worker.job_options and worker.errors, as the Python API (visbatch.api)
does; nothing outside this package imports typer (tests/test_layers.py)."""
