"""Real faults for the fleet tests: a TCP proxy that can cut a service off, and a throwaway
Redis server that can be restarted. Only loopback addresses are used, but for a proxy that a
test's own network namespace reaches (tests/test_two_hosts.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port free now, for a server of the test's own, taken below the kernel's
    ephemeral range: a server that is stopped and started again (a restarted Redis, a proxy cut
    and restored) must find its port still free, and any outgoing connection of any process (the
    other xdist worker's, a worker's to PostgreSQL) may take a free port of that range meanwhile."""
    low, _high = _ephemeral_range()
    start = max(1024, low - 12000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(start, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{low - 1}")


class TCPProxy:
    """Forwards listen_host:port (127.0.0.1 unless given) to a target. `cut()` drops every
    connection and refuses new ones (the service is "down" for the client), `restore()` brings it
    back."""

    def __init__(
        self, target_port: int, target_host: str = "127.0.0.1", listen_host: str = "127.0.0.1"
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.port = free_port()
        self._up = threading.Event()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.restore()
        self._thread.start()

    def _listen(self) -> socket.socket:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((self.listen_host, self.port))
        except OSError:
            server.close()
            raise
        server.listen(64)
        server.settimeout(0.2)
        return server

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._up.is_set() or self._server is None:
                time.sleep(0.05)
                continue
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            # Both ends blocking, with no timeout: the connect's 5 s would stay on the upstream
            # socket, and a connection idle for 5 s (a pooled Redis client between two sweeps,
            # Celery's broadcast channel) would end as if the server had closed it.
            for sock in (client, upstream):
                sock.settimeout(None)
            with self._lock:
                if not self._up.is_set():
                    # Accepted as the cut closed the listener: dropped like the others, not kept
                    # open through the outage on the proxy's own port.
                    for sock in (client, upstream):
                        sock.close()
                    continue
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._up.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass

    def restore(self) -> None:
        if self._server is None:
            # The port may stay held for a moment after the cut (a connection the listener took
            # as it closed): try again for a while before calling the restore failed.
            deadline = time.monotonic() + 30
            while True:
                try:
                    self._server = self._listen()
                    break
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        self._up.set()

    def close(self) -> None:
        self._stop.set()
        self.cut()

    def outage(self, seconds: float) -> None:
        """The service "restarts" for its clients: every connection dropped, new ones refused for
        `seconds`, then accepted again."""
        self.cut()
        try:
            time.sleep(seconds)
        finally:
            self.restore()


class RedisServer:
    """A Redis of the test's own, persisted with AOF (like the production broker) so a restart
    keeps its queues."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.port = free_port()
        self.dir = workdir
        self.args = list(args)  # more redis-server flags, e.g. "--maxmemory", "1mb" (they win)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--maxmemory-policy", "noeviction", *self.args]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def restart(self, down_seconds: float = 2.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


class FlakyS3Proxy:
    """An HTTP proxy in front of an S3 server that answers every `every`-th request with
    503 SlowDown (what S3 says when throttling), to prove that clients retry."""

    def __init__(self, target: str, every: int = 3) -> None:
        import http.client
        import http.server
        from urllib.parse import urlparse

        parsed = urlparse(target)
        proxy = self
        self.every, self.requests, self.failures = every, 0, 0
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.requests += 1
                    fail = proxy.requests % proxy.every == 0
                    proxy.failures += fail
                if fail:
                    error = b"<Error><Code>SlowDown</Code><Message>Slow down.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                upstream = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
                upstream.request(self.command, self.path, body=body or None, headers=dict(self.headers))
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.port = free_port()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PostgresCluster:
    """A PostgreSQL cluster of the test's own (initdb, pg_ctl), so that it can be stopped and
    started again without touching the machine's server. Runs as the `postgres` user when the
    test runs as root (the server refuses root); trust authentication, loopback only."""

    def __init__(self, bin_dir: str | None = None) -> None:
        import pwd
        import tempfile

        found = shutil.which("initdb") or "/usr/local/bin/initdb"
        self.bin = Path(bin_dir) if bin_dir else Path(found).parent
        self.port = free_port()
        # Under /tmp, not pytest's tmp_path: its root is private to the user running the tests.
        self.dir = Path(tempfile.mkdtemp(prefix="visbatch-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self._as, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed: {done.stdout}{done.stderr}{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "start")

    def stop(self) -> None:
        """A fast shutdown: every session is ended, as in a restart or a failover."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def outage(self, seconds: float) -> None:
        self.stop()
        try:
            time.sleep(seconds)
        finally:
            self.start()

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as conn:  # fmt: skip
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)
