"""Streaming ASR: Whisper (CTranslate2 via faster-whisper), one engine for all sessions.

The engine wires three parts, each in its own module:

    AsrStream (asr_stream)  ──Job──>  PassQueue (asr_queue)  ──Window──>  WhisperRunner (asr_runner)
    one per session: audio          which pass runs next:           one pass: encode,
    in, partial and final           finals before partials,         decode, word times
    results out (event loop)        batches, finals between steps   (a worker thread)

Worker threads (one by default; ``workers`` for machines with cores to spare) serve
every stream from the one queue, so under load partials get rarer and finals are never
dropped. Model compute never runs on the event loop. The types callers import are in
`models.asr_types`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from audio_io.pcm import pcm16_to_float
from models.asr_queue import Job, PassQueue
from models.asr_runner import WhisperRunner, one_shot
from models.asr_stream import AsrStream
from models.asr_types import SAMPLE_RATE, AsrClosed


class AsrEngine(WhisperRunner):
    """The Whisper runner, its passes served to every session by worker threads."""

    def __init__(
        self,
        model_path: str | Path,
        compute_type: str = "int8",
        cpu_threads: int = 1,
        device: str = "cpu",
        workers: int = 1,
    ) -> None:
        super().__init__(model_path, compute_type, cpu_threads, device, replicas=workers)
        self.queue = PassQueue()
        self._threads = [self._worker(i) for i in range(workers)]

    def _worker(self, i: int) -> threading.Thread:
        thread = threading.Thread(target=self._work, name=f"asr-engine-{i}", daemon=True)
        thread.start()
        return thread

    def _work(self) -> None:
        while (jobs := self.queue.take()) is not None:
            if jobs:  # (all cancelled while they waited: none)
                self.queue.run(jobs, self)

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def restart(self) -> int:
        """Start a worker in place of each one that died; how many were restarted. The
        queue is kept: the passes waiting in it run on the new workers."""
        dead = [i for i, t in enumerate(self._threads) if not t.is_alive()]
        for i in dead:
            self._threads[i] = self._worker(i)
        return len(dead)

    def stream(self, partial_interval_ms: int = 500) -> AsrStream:
        return AsrStream(self, partial_interval_ms * SAMPLE_RATE // 1000)

    def submit(self, job: Job) -> None:
        self.queue.submit(job)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the workers after the passes in progress, waiting at most ``timeout`` s
        for them all (a long pass is left to finish in its daemon thread: shutdown must
        not wait for a 30 s window); idempotent. Every pass that will not complete by
        then, queued or in progress, fails at once: nobody waits on a closed engine."""
        closed = AsrClosed("the ASR engine is closed")
        self.queue.fail_waiting(closed)
        self.queue.stop(len(self._threads))
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.queue.fail_running(closed)  # a long pass left to finish: its result comes to nobody

    async def transcribe_queued(self, samples: npt.NDArray[np.int16]) -> str:
        """`transcribe`, each window a final pass on the worker queue: it waits its turn
        behind other sessions' finals, ahead of their partials, off the event loop."""
        loop, passes = asyncio.get_running_loop(), one_shot(pcm16_to_float(samples))
        try:
            window = next(passes)
            while True:
                job = Job(window.audio, window.offset, [], True, loop)
                job.word_times = window.word_times
                self.submit(job)
                try:
                    hyp = await job.future
                finally:
                    job.cancelled = True  # a cancelled wait: the worker skips it if not begun
                window = passes.send(hyp)
        except StopIteration as done:
            text: str = done.value
            return text

    # the queue's counters and running passes (benchmarks, tests)

    @property
    def passes(self) -> int:
        return self.queue.passes

    @property
    def batches(self) -> int:
        return self.queue.batches

    @property
    def finals_from_partials(self) -> int:
        return self.queue.finals_from_partials

    @property
    def finals_ahead(self) -> int:
        return self.queue.finals_ahead

    @property
    def busy_s(self) -> float:
        return self.queue.busy_s

    @property
    def _running(self) -> set[Job]:
        return self.queue.running
