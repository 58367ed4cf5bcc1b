"""A broker reconnect, logged as what it is: one WARNING line with the cause and what happens next.

Celery and kombu log a routine reconnect as a disaster. A 3-s RabbitMQ cut: `CRITICAL
celery.worker.request: Couldn't ack 4, reason: RecoverableConnectionError(...)` with a traceback
per task that finished meanwhile (its message is handed out again and redone: tasks are
idempotent); a Redis restart: the loss, a 9-line deprecation nag, "Restoring N unacknowledged
message(s)", a prefetch note, an ERROR of three lines per retry, and a task's retry that could
not be published rejected with a 60-line traceback (`IndexError: pop from empty list` in kombu's
channel pool on the way). Nothing there needs a person, yet it reads as a crash.

`ReconnectLogs` is a filter on the root logger's handlers of a worker process (`install`): it
knows those records by logger and message, and turns one reconnect ("episode") into

    WARNING ... broker connection lost (OSError: ...): reconnecting; the messages this worker
    held go back to their queue and are redone (tasks are idempotent)
    INFO ... broker connection back after 4 s (2 tries; 3 unacknowledged message(s) returned)

with one more WARNING a minute while the broker stays away (Celery gives up after 100 tries and
the worker exits, logged as before). The other records of the episode, and the acknowledgements
that fail for a few minutes after it (tasks started before the cut), are kept only under
`--verbose` (at DEBUG). A task's Reject (a retry that could not be published, a warm shutdown's
hand-back) is one line without its traceback: the reason says it all. Anything this does not
recognise passes untouched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Kinds of record this filter knows.
LOST, RETRY, ACK, RESTORED, PREFETCH, CONNECTED, NAG, REJECTED = (
    "lost", "retry", "ack", "restored", "prefetch", "connected", "nag", "rejected",
)  # fmt: skip

_CONSUMER = "celery.worker.consumer.consumer"


def classify(record: logging.LogRecord) -> str | None:
    """Which known reconnect record this is; None for any other."""
    name = record.name
    if name == "py.warnings":
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - not one of ours
            return None
        return NAG if "worker_cancel_long_running_tasks_on_connection_loss" in text else None
    if not name.startswith(("celery", "kombu")):
        return None
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a record that cannot be formatted is not one of ours
        return None
    if name == _CONSUMER:
        if message.startswith("consumer: Connection to broker lost"):
            return LOST
        if message.startswith("consumer: Cannot connect to"):
            return RETRY
        if message.startswith(
            (
                "Skipping prefetch count reduction",
                "Temporarily reducing the prefetch",
                "Resuming normal operations following a restart",
            )
        ):
            return PREFETCH
        return None
    if name == "celery.worker.consumer.connection" and message.startswith("Connected to"):
        return CONNECTED
    if name == "celery.worker.request" and message.startswith(("Couldn't ack", "Couldn't reject")):
        return ACK
    if name.startswith("kombu") and message.startswith("Restoring") and "unacknowledged" in message:
        return RESTORED
    if name == "celery.app.trace" and record.exc_info and type(record.exc_info[1]).__name__ == "Reject":
        return REJECTED
    return None


def _cause(record: logging.LogRecord) -> str:
    """The error behind a record, as `Type: message`: Celery and kombu pass it as the second
    argument of each (the loss, a connect retry, a failed ack)."""
    args = record.args if isinstance(record.args, tuple) else ()
    exc = args[1] if len(args) >= 2 else None
    if isinstance(exc, BaseException):
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if isinstance(exc, OSError) and not text and exc.args:
            text = str(exc.args[0])
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return str(exc or "the connection dropped")


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


@dataclass
class _Episode:
    started: float
    said_at: float  # when the last WARNING of this episode was let through
    tries: int = 0  # connect attempts that failed
    losses: int = 1
    restored: int = 0
    back_at: float | None = None  # connected again (since the last loss)
    back_said: bool = False  # the "back" line is said once, unless a WARNING came after it


class ReconnectLogs(logging.Filter):
    """See the module's docstring. `clock` is the test seam."""

    def __init__(
        self,
        *,
        remind_s: float = 60.0,
        settle_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        verbose: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()
        self.remind_s = remind_s  # a WARNING this often while the broker stays away
        # After a reconnect, late failed acks and a flapping connection belong to the same episode
        # for this long (a task started before the cut may finish minutes later).
        self.settle_s = settle_s
        self.clock = clock
        self.verbose = verbose or (lambda: logging.getLogger().isEnabledFor(logging.DEBUG))
        self.episode: _Episode | None = None
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = classify(record)
        if kind is None:
            return True
        if kind == NAG:
            return False  # Celery's deprecation note, once per reconnect: nothing to act on
        if kind == REJECTED:
            return self._one_line_reject(record)
        with self._lock:
            return self._in_episode(kind, record)

    def _in_episode(self, kind: str, record: logging.LogRecord) -> bool:
        now = self.clock()
        episode = self.episode
        if episode is not None and episode.back_at is not None and now - episode.back_at > self.settle_s:
            episode = self.episode = None  # settled: the next loss is a new episode
        if episode is None:
            if kind == LOST:
                self.episode = _Episode(now, now)
                return _say(record, logging.WARNING, f"broker connection lost ({_cause(record)}): "
                            "reconnecting; the messages this worker held go back to their queue and "
                            "are redone (tasks are idempotent)")  # fmt: skip
            if kind == ACK:
                self.episode = _Episode(now, now)
                return _say(record, logging.WARNING, f"broker connection lost ({_cause(record)}): "
                            "a finished task's message could not be acknowledged; the broker hands it "
                            "out again and it is redone (tasks are idempotent); reconnecting")  # fmt: skip
            if kind == RETRY:
                self.episode = _Episode(now, now, tries=1)
                return _say(record, logging.WARNING, f"cannot reach the broker ({_cause(record)}): "
                            "retrying every few seconds")  # fmt: skip
            return True  # a start's "Connected to", a warm shutdown's restore: as they are
        since = _duration(now - episode.started)
        if kind == RETRY:
            episode.tries += 1
            if now - episode.said_at >= self.remind_s:
                episode.said_at, episode.back_said = now, False
                return _say(record, logging.WARNING, f"still no broker after {since} ({episode.tries} "
                            f"failed tries; {_cause(record)}): retrying")  # fmt: skip
        elif kind == LOST and episode.back_at is not None:
            # Lost again soon after coming back (a flapping link): the same episode, said again
            # at most once a minute.
            episode.back_at = None
            episode.losses += 1
            if now - episode.said_at >= self.remind_s:
                episode.said_at, episode.back_said = now, False
                return _say(record, logging.WARNING, f"broker connection lost again ({episode.losses} "
                            f"times in {since}; {_cause(record)}): reconnecting")  # fmt: skip
        elif kind == RESTORED:
            args = record.args if isinstance(record.args, tuple) else ()
            if args and isinstance(args[0], int):
                episode.restored += args[0]
        elif kind == CONNECTED and episode.back_at is None:
            episode.back_at = now
            if not episode.back_said:
                episode.back_said = True
                details = [f"{episode.tries} failed tries"] if episode.tries else []
                details += (
                    [f"{episode.restored} unacknowledged message(s) returned"] if episode.restored else []
                )
                shown = f" ({'; '.join(details)})" if details else ""
                return _say(record, logging.INFO, f"broker connection back after {since}{shown}")
        return self._quiet(record)

    def _quiet(self, record: logging.LogRecord) -> bool:
        """Kept at DEBUG under --verbose, dropped otherwise."""
        if not self.verbose():
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True

    @staticmethod
    def _one_line_reject(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        reason = getattr(exc, "reason", None) or exc
        context = record.args if isinstance(record.args, dict) else {}
        task = f"{context.get('name', 'task')}[{context.get('id', '?')}]"
        what = "handed back to the broker" if getattr(exc, "requeue", False) else "rejected"
        return _say(record, record.levelno, f"Task {task} {what}: {reason}")


def _say(record: logging.LogRecord, level: int, message: str) -> bool:
    """Rewrite `record` as one line at `level`, without a traceback."""
    record.msg, record.args = message, None
    record.levelno, record.levelname = level, logging.getLevelName(level)
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


def install(logger: logging.Logger | None = None) -> ReconnectLogs:
    """Put one ReconnectLogs on each handler of `logger` (the root logger): records of any logger
    reach them, and a prefork pool's processes inherit them."""
    logger = logger or logging.getLogger()
    found = [f for h in logger.handlers for f in h.filters if isinstance(f, ReconnectLogs)]
    if found:
        return found[0]
    shared = ReconnectLogs()
    for handler in logger.handlers:
        handler.addFilter(shared)
    return shared
