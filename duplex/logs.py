"""Structured logging: one line per event, as text or JSON, with secrets masked.

Secrets are masked in the formatted line, after fields and tracebacks are rendered,
so a token cannot reach the log through a URL in a field or an exception message.

Fields go in ``extra={"fields": {...}}``; the JSON formatter emits them as keys, the
text formatter as ``key=value`` pairs after the message.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


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


def setup_logging(level: str, fmt: str, secrets: list[str] | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    inner = JsonFormatter() if fmt == "json" else TextFormatter()
    handler.setFormatter(RedactingFormatter(inner, secrets or []))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp.access",):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
