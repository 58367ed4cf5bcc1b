"""The command line (`visbatch ...`, typer): main.py declares the commands, one module per command
family (run/submit/resume, ingest, plan, purge, review) holds their bodies, output.py and
inputs.py what they print and read. It sits on worker.options and worker.errors, as the Python
API (visbatch.api) does."""
