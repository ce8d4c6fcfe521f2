"""The ASR pass queue: which passes run next, together, or not at all.

Every stream's passes (`Job`s) wait in one queue that the engine's worker threads serve:
finals before partials, in the order they came. A final takes the finals waiting behind
it into its batch, up to `MAX_BATCH`, decoded together; a partial runs alone, since a
batch of partials would keep the next final waiting for the whole batch. A partial pass lets
the finals that come while it runs go first, between its decoding steps, so that a final
waits a step and not the rest of a pass; a partial a pause took as its final does not
yield (it is that final). A pass whose every request was cancelled (a partial its
stream's final superseded) is skipped if not begun, and stops at its next step if begun.

Plain bookkeeping: the runner that computes a pass is handed in (`Runner`), so the queue
is tested with a stub one (tests/test_asr_queue.py). Thread-safe: workers take and run
passes while the event loop submits them. docs/performance.md has the measurements
behind these choices.

    queue:  F1 F2 F3 F4 F5 P1 P2        F: finals, P: partials, in arrival order
    take(): [F1 F2 F3 F4] [F5] [P1] [P2]
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from models.agreement import HypWord, word_key
from models.asr_types import Hypothesis, Window
from models.handoff import cancel_from_thread, resolve_from_thread

log = logging.getLogger("duplex.asr")

MAX_BATCH = 4  # finals of different streams decoded together (`Runner.transcribe_batch`)

_FINAL, _PARTIAL, _STOP = 0, 1, -1  # priorities in the queue: lowest first


class Runner(Protocol):
    """What the queue needs of the Whisper runner (`models.asr_runner.WhisperRunner`)."""

    def transcribe_batch(
        self, windows: list[Window], between: Callable[[], None] | None = None
    ) -> list[Hypothesis]: ...

    def with_times(self, hyp: Hypothesis) -> Hypothesis: ...


@dataclass(eq=False)
class Job:
    """One stream's request for a pass, and the future its result comes to."""

    audio: npt.NDArray[np.float32]
    offset: int  # stream position of audio[0]
    prefix: list[int]
    final: bool
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    taken_as_final: bool = False  # a partial a pause took as its final (`AsrStream.pause`)
    compute_ms: float = 0.0
    previous: list[int] = field(default_factory=list)  # text tokens before the window
    previous_keys: list[str] = field(default_factory=list)  # words of the previous hypothesis
    draft: list[int] = field(default_factory=list)  # its tokens after the committed words
    committed: int = 0  # how many words are committed
    earlier: tuple[HypWord, ...] = ()  # the utterance's words before the window, when submitted
    word_times: bool = False  # align a final pass for word times
    future: asyncio.Future[Hypothesis] = field(init=False)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()

    def may_commit(self, words: list[HypWord]) -> bool:
        """Would this pass commit a word? (Then it is worth aligning for word times.)"""
        i = self.committed
        return i < min(len(words), len(self.previous_keys)) and word_key(words[i]) == self.previous_keys[i]

    @property
    def end(self) -> int:
        return self.offset + self.audio.size

    @property
    def window(self) -> Window:
        return Window(self.audio, self.offset, self.prefix, self.previous, self.draft)

    def deliver(self, result: Hypothesis | BaseException) -> None:
        resolve_from_thread(self.loop, self.future, result)

    def drop(self) -> None:
        """The pass stopped unfinished, its requests cancelled: nobody awaits it."""
        cancel_from_thread(self.loop, self.future)


class _Superseded(Exception):
    """A pass stopped between its steps: its requests were all cancelled meanwhile."""


class PassQueue:
    def __init__(self) -> None:
        self._jobs: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()  # the counters and `running`
        self.running: set[Job] = set()  # the passes the workers are running
        self.passes = 0
        self.batches = 0  # decoder calls: passes decoded together count once
        self.finals_from_partials = 0  # pauses whose final was the partial pass in flight
        self.finals_ahead = 0  # final batches run in the middle of a partial pass (`run`)
        self.busy_s = 0.0  # worker time spent in passes

    def submit(self, job: Job) -> None:
        self._jobs.put((_FINAL if job.final else _PARTIAL, next(self._seq), job))

    def take_as_final(self, partial: Job) -> None:
        """A pause takes the partial pass in flight as its final: it lets no final run
        ahead of it now."""
        partial.taken_as_final = True
        self.finals_from_partials += 1

    def stop(self, workers: int) -> None:
        """Each of ``workers`` takes a stop (None) before any pass still waiting."""
        for _ in range(workers):
            self._jobs.put((_STOP, next(self._seq), None))

    def fail_waiting(self, error: BaseException) -> None:
        """Every pass waiting gets ``error``; the queue is left empty (stops too)."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item[2] is not None:
                item[2].deliver(error)

    def fail_running(self, error: BaseException) -> None:
        """Every pass running gets ``error`` now; whatever it computes comes to nobody."""
        with self._lock:
            running = list(self.running)
        for job in running:
            job.deliver(error)

    def take(self) -> list[Job] | None:
        """The next passes to run, waiting for one: the first in the queue (finals before
        partials), and, for a final, the finals already waiting behind it, up to
        `MAX_BATCH`; cancelled ones left out (so possibly none). None: stop."""
        first = self._jobs.get()
        if first[2] is None:
            return None
        return self._batch(first)

    def _batch(self, first: tuple[int, int, Job | None]) -> list[Job]:
        assert first[2] is not None
        jobs = [first[2]]
        while first[0] == _FINAL and len(jobs) < MAX_BATCH:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item[2] is None or item[0] != first[0]:  # a stop, or a partial
                self._jobs.put(item)
                break
            jobs.append(item[2])
        return [job for job in jobs if not job.cancelled]

    def finals_waiting(self) -> list[Job] | None:
        """The finals at the head of the queue, batched as `take` does (cancelled ones
        left out); None when the head is no final."""
        with self._jobs.mutex:  # a look first: most steps find no final
            if not self._jobs.queue or self._jobs.queue[0][0] != _FINAL:
                return None
        try:
            first = self._jobs.get_nowait()
        except queue.Empty:
            return None
        if first[0] != _FINAL:  # another worker took the final meanwhile
            self._jobs.put(first)
            return None
        return self._batch(first)

    def run(self, jobs: list[Job], runner: Runner) -> None:
        """One pass over ``jobs``, its results delivered. A partial pass runs the finals
        waiting at the queue's head first, whenever ``runner`` calls back between its
        steps (`Runner.transcribe_batch`'s ``between``); its own compute time counts
        without theirs. A pass whose every request was cancelled meanwhile stops at its
        next step, its futures cancelled."""
        started = time.perf_counter()
        yielded = 0.0  # time the finals run ahead took, not this pass's

        def finals_first() -> None:
            nonlocal yielded
            if not any(job.final or job.taken_as_final for job in jobs):
                began = time.perf_counter()
                while (finals := self.finals_waiting()) is not None:
                    if finals:
                        with self._lock:
                            self.finals_ahead += 1
                        self.run(finals, runner)
                yielded += time.perf_counter() - began
            if all(job.cancelled for job in jobs):
                raise _Superseded("every request of this pass was cancelled while it ran")

        with self._lock:
            self.running.update(jobs)
        results: list[Hypothesis | BaseException] | None  # None: dropped, nobody waits for it
        try:
            hypotheses = runner.transcribe_batch([job.window for job in jobs], finals_first)
            finals_first()
            # Word times only matter for words about to be committed: align only
            # when this pass agrees with the previous one beyond what is committed.
            # A final pass aligns only when its stream asks for word times: the
            # alignment is on the turn's critical path.
            results = [
                runner.with_times(h)
                if h.tokens and (j.word_times if j.final else j.may_commit(h.words))
                else h
                for j, h in zip(jobs, hypotheses, strict=True)
            ]
        except _Superseded:
            results = None
        except Exception as e:  # a bad pass fails its requests, not the engine
            log.exception("ASR pass failed (%d windows)", len(jobs))
            results = [e] * len(jobs)
        except BaseException:  # the worker ends (the engine watch starts another): the passes fail first
            for job in jobs:
                job.deliver(RuntimeError("the ASR worker stopped during this pass"))
            raise
        finally:
            with self._lock:
                self.running.difference_update(jobs)
        elapsed = time.perf_counter() - started - yielded
        with self._lock:
            self.passes += len(jobs)
            self.batches += 1
            self.busy_s += elapsed
        for i, job in enumerate(jobs):
            job.compute_ms = elapsed * 1000
            if results is None:
                job.drop()
            else:
                job.deliver(results[i])
