"""Structured logging: one line per event, as text or JSON, with secrets masked.

Secrets are masked in the formatted line, after fields and tracebacks are rendered,
so a token cannot reach the log through a URL in a field or an exception message.

Fields go in ``extra={"fields": {...}}``; the JSON formatter emits them as keys, the
text formatter as ``key=value`` pairs after the message.

vLLM's lines come through here too (`route_vllm_logs`), those of its engine-core
process included: vLLM applies its own ``dictConfig`` in every process it starts
(``VLLM_LOGGING_CONFIG_PATH``), and ours hands its ``vllm`` logger this process's
handler. Python warnings become log lines as well, so that in JSON mode every line
the service writes is one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

# the service's secrets, for the processes vLLM spawns (not DUPLEX_*: that prefix is the
# config's); in the environment only, as DUPLEX_AUTH_TOKEN itself may be
SECRETS_ENV = "_DUPLEX_LOG_SECRETS"


class RedactingFormatter(logging.Formatter):
    """Masks secrets in the finished line: message, fields and traceback alike."""

    def __init__(self, inner: logging.Formatter, secrets: list[str]) -> None:
        super().__init__()
        self._inner = inner
        self._secrets = [s for s in secrets if s]

    def format(self, record: logging.LogRecord) -> str:
        line = self._inner.format(record)
        for secret in self._secrets:
            line = line.replace(secret, "***")
        return line


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,  # vLLM's engine core logs from its own process
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        return f"{line} {extra}" if extra else line


class ServiceHandler(logging.StreamHandler):
    """The service's one output: stderr, as text or JSON, secrets masked."""

    def __init__(self, fmt: str, secrets: list[str]) -> None:
        super().__init__(sys.stderr)
        self.fmt = fmt
        self.secrets = [s for s in secrets if s]
        inner = JsonFormatter() if fmt == "json" else TextFormatter()
        self.setFormatter(RedactingFormatter(inner, secrets))

    def emit(self, record: logging.LogRecord) -> None:
        # a start-up progress bar on the terminal (duplex.startup) steps aside for the line
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def setup_logging(level: str, fmt: str, secrets: list[str] | None = None) -> None:
    handler = ServiceHandler(fmt, secrets or [])
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp.access",):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(True)  # a warning is a log line too (JSON in JSON mode)


def route_vllm_logs(level: str, fmt: str, directory: Path) -> Path:
    """Send vLLM's log lines, in this process and in the processes vLLM starts, through
    this service's logging: write the ``dictConfig`` that vLLM applies in each of its
    processes and point ``VLLM_LOGGING_CONFIG_PATH`` at it (call before the engine
    starts). It holds no secret; the handler comes from `vllm_handler` there."""
    # the logger lets INFO through even at a higher level: the start-up phases are
    # read from vLLM's INFO lines (`duplex.startup.VllmPhaseTap`); the handler that
    # writes them keeps the level asked for
    logger_level = min(logging.getLevelName(level.upper()), logging.INFO)
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {
            "duplex": {
                "()": "duplex.logs.vllm_handler",
                "fmt": fmt,
                "root_level": level.upper(),
                "level": level.upper(),
            },
            "duplex_phases": {"()": "duplex.logs.vllm_phase_tap"},
        },
        "loggers": {
            "vllm": {
                "handlers": ["duplex", "duplex_phases"],
                "level": logging.getLevelName(logger_level),
                "propagate": False,
            }
        },
    }
    secrets = next((h.secrets for h in logging.getLogger().handlers if isinstance(h, ServiceHandler)), [])
    if secrets:  # for a process vLLM spawns (a forked one inherits the handler itself)
        os.environ[SECRETS_ENV] = json.dumps(secrets)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"vllm-logging-{fmt}-{level.lower()}.json"
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(config, indent=1))
    staging.replace(path)  # another service starting at once writes the same file
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    return path


def vllm_handler(fmt: str, root_level: str) -> logging.Handler:
    """For vLLM's ``dictConfig``: this process's `ServiceHandler` (this process, and a
    forked engine core, which inherits it). A process vLLM spawned afresh (its engine
    core, on the CPU) has none: its logging is set up as the service's is, with the
    same format and level and the same secrets masked (``SECRETS_ENV``)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, ServiceHandler):
            return handler
    try:
        secrets = [str(s) for s in json.loads(os.environ.get(SECRETS_ENV, "[]"))]
    except ValueError:
        secrets = []
    setup_logging(root_level, fmt, secrets)
    return logging.getLogger().handlers[0]


def vllm_phase_tap() -> logging.Handler:
    """For vLLM's ``dictConfig``: what tells the service's start-up which phase the
    LLM is in (`duplex.startup.VllmPhaseTap`): the tap itself in the service's process
    and a forked child, a `duplex.startup.PhaseSender` in a spawned one while the
    service listens; else a handler that does nothing."""
    from duplex.startup import SOCKET_ENV, PhaseSender, VllmPhaseTap

    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, VllmPhaseTap):
            return handler
    path = os.environ.get(SOCKET_ENV)
    return PhaseSender(path) if path else logging.NullHandler()


@contextlib.contextmanager
def json_output(secrets: list[str]) -> Iterator[None]:
    """JSON mode: every line this process and the processes it starts write to stdout
    or stderr reaches stderr as one JSON object. Log lines are JSON already and pass as
    they are; anything else (a C++ library's warning, a progress bar, a child's line
    from before its logging was set up) is wrapped: logger ``stderr``, level from its
    ``[W``/``[E`` prefix if it has one, secrets masked. Both file descriptors point at a
    pipe that a thread reads, and are put back on exit (what a child writes after that
    finds no reader)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    real_out, real_err = os.dup(1), os.dup(2)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    stop = threading.Event()
    pump = threading.Thread(
        target=_pump,
        args=(read_fd, real_err, [s for s in secrets if s], stop),
        name="json-output",
        daemon=True,
    )
    pump.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(real_out, 1)
        os.dup2(real_err, 2)
        stop.set()
        pump.join(timeout=1.0)
        for fd in (real_out, real_err, read_fd):
            os.close(fd)


def wrap_line(line: str, secrets: list[str]) -> str:
    """One line of output as a JSON log line: itself if it is one already."""
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line
        except ValueError:
            pass
    for secret in secrets:
        line = line.replace(secret, "***")
    level = {"[W": "warning", "[E": "error", "[F": "critical"}.get(line[:2], "info")
    now = time.time()
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    return json.dumps({"ts": ts, "level": level, "logger": "stderr", "msg": line, "pid": None})


def _pump(read_fd: int, out_fd: int, secrets: list[str], stop: threading.Event) -> None:
    buffered = b""
    while True:
        ready, _, _ = select.select([read_fd], [], [], 0.05 if stop.is_set() else 0.5)
        chunk = os.read(read_fd, 65536) if ready else b""
        if not chunk and (stop.is_set() or ready):  # drained at exit, or every writer gone
            chunk, buffered = buffered + b"\n", b""
            if chunk == b"\n":
                return
        buffered += chunk
        *lines, buffered = re.split(rb"[\r\n]", buffered)
        out = "".join(
            wrap_line(text, secrets) + "\n" for raw in lines if (text := raw.decode(errors="replace").strip())
        )
        if out:
            os.write(out_fd, out.encode())
