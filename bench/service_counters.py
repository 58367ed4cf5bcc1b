"""Services of the bench's own, each counting what crosses its wire (bench/unit_costs.py,
bench/control_plane.py).

- `RedisProcess`: a dedicated redis-server (the broker: AOF like production, noeviction; the cache:
  allkeys-lru, no persistence); `counts()` reads its INFO commandstats and network byte counters.
- `CountingS3`: moto's S3 API (ThreadedMotoServer's app) behind a WSGI layer that counts requests
  by method and the bytes of their bodies in and out.
- `AmqpCounter`: a TCP relay in front of RabbitMQ that parses the AMQP 0-9-1 frames going
  through it and counts the methods that carry messages (basic.publish, basic.deliver, basic.ack
  ...) and the bytes, both ways. There is no management API here, so this is how a message
  that crossed the wire is told from one that did not.
- `usage_totals`: the sum of every process's storage.usage file (SQL, Celery signals).
- `cpu_seconds(pid)`: user + system CPU of a process (and its waited-for children) from /proc.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

RABBITMQ = ("127.0.0.1", 5672)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and of its children it waited for (/proc/PID/stat)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw.rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime + cutime + cstime) / CLOCK_TICKS


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and of every live descendant (a supervised worker's pool)."""
    total, seen, todo = 0.0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += cpu_seconds(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            children = []
        todo.extend(int(c) for c in children)
    return total


class RedisProcess:
    """A redis-server of the bench's own on a free port."""

    def __init__(self, workdir: Path, *, role: str) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(self.port),
                "--bind", "127.0.0.1", "--dir", str(workdir), "--save", ""]  # fmt: skip
        if role == "broker":  # as a production broker: every write on disk, never evicting
            argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]
        else:  # the hot token cache
            argv += ["--appendonly", "no", "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def counts(self) -> dict[str, int]:
        """Commands by name (INFO commandstats: our own INFO calls left out) and bytes in and out."""
        import redis

        client = redis.Redis(port=self.port)
        try:
            stats = client.info("commandstats")
            net = client.info("stats")
        finally:
            client.close()
        out = {f"redis.{k.removeprefix('cmdstat_')}": int(v["calls"]) for k, v in stats.items()}
        out.pop("redis.info", None)
        out["redis.commands"] = sum(out.values())
        out["redis.bytes_in"] = int(net["total_net_input_bytes"])
        out["redis.bytes_out"] = int(net["total_net_output_bytes"])
        return out

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


class CountingS3:
    """moto's S3 on a free port, counting every request (by method) and body bytes both ways."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            os.environ.pop(name, None)
        os.environ.update(
            AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
        )
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)
        self.port = free_port()
        self._server = make_server(
            "127.0.0.1", self.port, self._counting(app), True, request_handler=MotoRequestHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _counting(self, app: Any) -> Any:
        def counted(environ: dict, start_response: Any) -> Any:
            method = environ.get("REQUEST_METHOD", "?")
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = b"".join(app(environ, start_response))
            with self._lock:
                self._counts["s3.requests"] += 1
                self._counts[f"s3.{method.lower()}"] += 1
                self._counts["s3.bytes_in"] += length
                self._counts["s3.bytes_out"] += len(body)
            return [body]

        return counted

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=name)

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


# AMQP 0-9-1 methods that move messages: (class id, method id) -> name.
_METHODS = {
    (60, 40): "basic.publish",
    (60, 60): "basic.deliver",
    (60, 70): "basic.get",
    (60, 80): "basic.ack",
    (60, 90): "basic.reject",
    (60, 120): "basic.nack",
    (60, 10): "basic.qos",
    (60, 20): "basic.consume",
    (50, 10): "queue.declare",
    (40, 10): "exchange.declare",
    (50, 20): "queue.bind",
}


class AmqpCounter:
    """A relay on a free port to RabbitMQ that counts AMQP frames and message methods each way."""

    def __init__(self, upstream: tuple[str, int] = RABBITMQ) -> None:
        self.upstream = upstream
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, vhost: str = "/") -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{'' if vhost == '/' else vhost}"

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, way: str) -> None:
        buffer = b""
        header_left = 8 if way == "up" else 0  # the client's protocol header, "AMQP\0\0\x09\x01"
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
                buffer += data
                if header_left:
                    skipped = min(header_left, len(buffer))
                    buffer, header_left = buffer[skipped:], header_left - skipped
                buffer = self._frames(buffer, way, len(data))
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _frames(self, buffer: bytes, way: str, received: int) -> bytes:
        seen: Counter[str] = Counter({f"amqp.bytes_{way}": received})
        while len(buffer) >= 7:
            kind, _channel, size = struct.unpack(">BHI", buffer[:7])
            if len(buffer) < 8 + size:
                break
            payload = buffer[7 : 7 + size]
            seen[f"amqp.frames_{way}"] += 1
            if kind == 1 and size >= 4:
                method = _METHODS.get(struct.unpack(">HH", payload[:4]))
                if method:
                    seen[f"amqp.{method}_{way}"] += 1
            elif kind == 8:
                seen[f"amqp.heartbeat_{way}"] += 1
            buffer = buffer[8 + size :]
        with self._lock:
            self._counts.update(seen)
        return buffer

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def usage_totals(directory: Path) -> dict[str, int]:
    """Every process's storage.usage counts, summed."""
    total: Counter[str] = Counter()
    for path in directory.glob("*.json"):
        try:
            total.update(json.loads(path.read_text())["counts"])
        except (OSError, ValueError, KeyError):
            continue  # being replaced right now: the next read has it
    return dict(total)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
