"""`Startup`: the phases of the service's start-up, for the log, ``/healthz`` and a terminal.

    prepare ─► load_vad ─► load_asr ─► load_tts ─► llm_engine ─► llm_weights ─► llm_compile ─► llm_warmup
    (child:     (this process, worker threads)   │   (vLLM's engine core, a child process:
     convert                                     │    its log lines say where it is)
     once)                                       └─► llm_service (with llm_url: reach the LLM
                                                      service, check its tokenizer; waits for it)

Each phase is logged as it begins and as it ends, with its elapsed time, and
`snapshot` (in ``/healthz``) says which phase is under way, for how long, and the ones
done with their times. On a terminal (stderr a TTY, text logs) a progress bar follows
the phases; never in JSON log mode, where every line must be a JSON object.

The LLM's own phases happen inside vLLM's engine-core process. vLLM logs through this
service's logging there too (`duplex.logs.route_vllm_logs`); a handler on its ``vllm``
logger there recognises the messages that begin each phase (`vllm_phase`) and sends
them to this process (`VllmPhaseTap`). The messages are vLLM 0.32's; a vLLM that words
them differently leaves the LLM in its ``llm_engine`` phase until it is up, and
nothing else changes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

log = logging.getLogger("duplex.startup")

# every phase, in order, with what it does (as the log and /healthz say it)
PHASES = {
    "prepare": "prepare the models (a GGUF LLM is converted once)",
    "load_vad": "load the VAD model",
    "load_asr": "load the ASR model",
    "load_tts": "load the TTS voice",
    "llm_engine": "start vLLM's engine core",
    "llm_service": "reach the LLM service and check its tokenizer",
    "llm_weights": "load the LLM's weights",
    "llm_compile": "compile the LLM's graph, or load the compiled one",
    "llm_warmup": "size the KV cache and warm up",
}

# vLLM 0.32's messages (the record's format string) that begin a phase or say how it goes
_VLLM_MARKERS = (
    ("Starting to load model", "llm_weights", ""),
    ("Warming up model for the compilation", "llm_compile", ""),
    ("Directly load the compiled graph", None, "loaded the compiled graph from the cache"),
    ("Directly load AOT compilation", None, "loaded the compiled graph from the cache"),
    ("Compiling a graph for", None, "compiled (the next start loads it)"),
    ("Warming up done.", "llm_warmup", ""),
)


def vllm_phase(message: str) -> tuple[str | None, str] | None:
    """What a vLLM log message says of the start-up: (the phase it begins, or None for
    the current one; a detail for that phase), or None if it says nothing of it."""
    for marker, phase, detail in _VLLM_MARKERS:
        if marker in message:
            return phase, detail
    return None


def wants_progress(log_format: str, stream: TextIO) -> bool:
    """A progress bar for a person at a terminal; never amid JSON lines, nor in a file."""
    return log_format == "text" and stream.isatty()


@dataclass(frozen=True)
class PhaseDone:
    name: str
    seconds: float
    detail: str = ""


class Startup:
    """The phases so far; thread-safe (the LLM's phases arrive from other threads)."""

    def __init__(self, progress: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._began = clock()
        self._done: list[PhaseDone] = []
        self._current: str | None = None
        self._current_since = 0.0
        self._detail = ""
        self._finished: float | None = None
        self._bar = _Bar(len(PHASES)) if progress else None

    def begin(self, name: str, detail: str = "") -> None:
        """``name`` begins (the phase under way, if any, ends)."""
        assert name in PHASES, f"unknown start-up phase {name!r} (add it to PHASES)"
        self.end()
        with self._lock:
            self._current, self._current_since, self._detail = name, self._clock(), detail
        log.info("start-up: %s", PHASES[name], extra={"fields": {"phase": name}})
        if self._bar is not None:
            self._bar.show(PHASES[name])

    def note(self, detail: str) -> None:
        """How the phase under way goes (e.g. whether the graph was compiled or loaded)."""
        with self._lock:
            if self._current is not None:
                self._detail = detail

    def end(self, detail: str | None = None) -> PhaseDone | None:
        """The phase under way (if any) ends; logged with its elapsed time."""
        with self._lock:
            if self._current is None:
                return None
            done = PhaseDone(
                self._current,
                round(self._clock() - self._current_since, 3),
                self._detail if detail is None else detail,
            )
            self._done.append(done)
            self._current = None
        fields = {"phase": done.name, "seconds": done.seconds} | (
            {"detail": done.detail} if done.detail else {}
        )
        log.info("start-up: %s took %.1f s", done.name, done.seconds, extra={"fields": fields})
        if self._bar is not None:
            self._bar.step()
        return done

    def finish(self) -> None:
        """Start-up is over (ready, or failed: then ``end`` said so first)."""
        self.end()
        with self._lock:
            if self._finished is not None:
                return
            self._finished = self._clock()
            seconds = round(self._finished - self._began, 3)
        log.info("start-up took %.1f s", seconds, extra={"fields": {"seconds": seconds}})
        if self._bar is not None:
            self._bar.close(done="started")

    @property
    def current(self) -> tuple[str, float] | None:
        """The phase under way and its seconds so far, if any."""
        with self._lock:
            if self._current is None:
                return None
            return self._current, self._clock() - self._current_since

    def snapshot(self) -> dict[str, Any]:
        """For ``/healthz`` (JSON)."""
        with self._lock:
            now = self._clock()
            current = None
            if self._current is not None:
                current = {
                    "name": self._current,
                    "what": PHASES[self._current],
                    "seconds": round(now - self._current_since, 1),
                } | ({"detail": self._detail} if self._detail else {})
            return {
                "phase": current,
                "done": [
                    {"name": d.name, "seconds": d.seconds} | ({"detail": d.detail} if d.detail else {})
                    for d in self._done
                ],
                "seconds": round((self._finished or now) - self._began, 1),
                "finished": self._finished is not None,
            }

    def close(self) -> None:
        """Stop the progress bar (at shutdown during start-up); idempotent."""
        if self._bar is not None:
            self._bar.close()


class _Bar:
    """A terminal progress bar over the phases; its elapsed time moves once a second
    (phases log nothing while they work) until `close`."""

    def __init__(self, total: int) -> None:
        self._bar = tqdm(total=total, unit="phase", bar_format="{desc}: {n}/{total} phases, {elapsed}")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="startup-bar", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._bar.refresh()

    def show(self, what: str) -> None:
        self._bar.set_description_str(what)

    def step(self) -> None:
        self._bar.update(1)

    def close(self, done: str = "") -> None:
        """Stop; ``done``: the start-up is over (phases it skipped, e.g. no compiling
        when eager, count as done)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._ticker.join(timeout=2.0)
        if done:
            self._bar.n = self._bar.total
            self._bar.set_description_str(done)
        self._bar.close()


# where a process vLLM started sends the phases its log lines begin (`VllmPhaseTap`)
SOCKET_ENV = "_DUPLEX_STARTUP_SOCKET"  # not DUPLEX_*: that prefix is the config's


class PhaseSender(logging.Handler):
    """On the ``vllm`` logger of a process vLLM started: each message that says where the
    start-up is (`vllm_phase`) goes to the service as one datagram, without blocking;
    once the service no longer listens, nothing is sent."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.path = path
        self._socket: socket.socket | None = None
        self._broken = False

    def emit(self, record: logging.LogRecord) -> None:
        said = vllm_phase(record.msg) if isinstance(record.msg, str) else None
        if said is not None and not self._broken:
            self.send(said)

    def send(self, said: tuple[str | None, str]) -> None:
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto(json.dumps(said).encode(), self.path)
        except OSError:  # the service no longer listens (start-up is over)
            self._broken = True


class VllmPhaseTap(PhaseSender):
    """A handler on the ``vllm`` logger that moves `Startup` through the LLM's phases.

    vLLM's engine core is another process (spawned on the CPU, forked elsewhere): there
    `duplex.logs.vllm_phase_tap` puts a `PhaseSender` on its ``vllm`` logger (a forked
    one inherits this handler, which sends as well), pointed at a Unix datagram socket
    this object binds in a private directory (``SOCKET_ENV`` names it to the processes
    started meanwhile) and a thread of this process reads. In this process the phases
    move directly. Use it as a context manager around the LLM's start: on exit the
    handler leaves the logger and the socket closes."""

    def __init__(self, startup: Startup) -> None:
        self._dir = tempfile.mkdtemp(prefix="duplex-startup-")
        super().__init__(os.path.join(self._dir, "phases"))
        self.startup = startup
        self._pid = os.getpid()
        self._listening: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._listening.bind(self.path)
        except OSError as e:  # e.g. a path too long for a socket: only this process's phases
            log.warning("the LLM's start-up phases will not be shown: %s", e)
            self._listening.close()
            self._listening = None
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    def send(self, said: tuple[str | None, str]) -> None:
        if os.getpid() == self._pid:
            return self.apply(*said)
        super().send(said)

    def apply(self, phase: str | None, detail: str) -> None:
        if phase is not None:
            self.startup.begin(phase, detail)
        elif detail:
            self.startup.note(detail)

    def _read(self, listening: socket.socket) -> None:
        while True:
            ready, _, _ = select.select([listening], [], [], 0.05 if self._stop.is_set() else 0.2)
            if not ready:
                if self._stop.is_set():  # and everything sent before it read
                    return
                continue
            datagram = listening.recv(4096)
            with contextlib.suppress(ValueError, TypeError):
                phase, detail = json.loads(datagram)
                if phase is None or phase in PHASES:
                    self.apply(phase, str(detail))

    def __enter__(self) -> VllmPhaseTap:
        if self._listening is not None:
            self._reader = threading.Thread(
                target=self._read, args=(self._listening,), name="vllm-phase-tap", daemon=True
            )
            self._reader.start()
            os.environ[SOCKET_ENV] = self.path
        logging.getLogger("vllm").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("vllm").removeHandler(self)
        if os.environ.get(SOCKET_ENV) == self.path:
            del os.environ[SOCKET_ENV]
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        if self._listening is not None:
            self._listening.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def phase(startup: Startup | None, name: str) -> Iterator[None]:
    """``name`` under way for the block (and ended with it), if there is a `Startup`."""
    if startup is None:
        yield
        return
    startup.begin(name)
    try:
        yield
    except BaseException:
        startup.end("failed")
        raise
    startup.end()
