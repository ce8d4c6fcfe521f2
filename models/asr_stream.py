"""`AsrStream`: one session's recognizer, from the utterance's audio to its results.

While the caller speaks, a partial pass runs every ``partial_interval`` of new audio
(none starts in a pause the VAD announced: the speculative final has the words).
Words two consecutive passes agree on are committed (`LocalAgreement`) and forced as
the decoder prefix of every later pass, so they are never retracted. When the VAD
reports a pause, the final pass of the utterance so far starts at once (or the partial
pass in flight serves as it, if it already heard `COVER` past the last word: one pass
sooner); if the pause becomes the end of the turn, that pass is the final and is usually
done before the end-of-speech event; if speech resumes it is discarded.

The stream only asks for passes (`Job`s on the engine's `PassQueue`) and reads their
results on the event loop; the passes run on the engine's worker threads.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np
import numpy.typing as npt

from audio_io.pcm import pcm16_to_float
from models.agreement import HypWord, LocalAgreement
from models.asr_queue import Job, PassQueue
from models.asr_types import PREVIOUS_TEXT_TOKENS, SAMPLE_RATE, AsrResult, AsrWord, Hypothesis

MAX_WINDOW = 20 * SAMPLE_RATE  # with nothing committed for this long, keep only the newest half
MAX_UTTERANCE_WORDS = 600  # ~3,600 characters, what one user turn can hold: longer keeps the newest
COVER = SAMPLE_RATE // 10  # audio past the last word that lets a partial pass serve as the final


class PassSource(Protocol):
    """What a stream needs of the engine (`models.asr.AsrEngine`): the queue its passes go to."""

    queue: PassQueue


class AsrStream:
    """One session's recognizer. Utterances run from `begin` to `finish`.

    Positions are sample indices of the session's 16 kHz stream (as the VAD counts).
    Partial results arrive on `results`; `finish` returns the final one.

    The audio window of a pass starts at the end of the last committed word once the
    window is longer than ``window_s``: committed words move out of the window, and
    their text is given to the decoder as previous-text context instead. Every pass
    then costs about the same however long the caller talks, and so does the final.
    """

    def __init__(self, engine: PassSource, partial_interval: int, window_s: float = 4.0) -> None:
        self._queue = engine.queue
        self.partial_interval = partial_interval
        self.window = int(window_s * SAMPLE_RATE)
        self._loop = asyncio.get_running_loop()
        self.results: asyncio.Queue[AsrResult] = asyncio.Queue(maxsize=64)
        self._active = False
        self.word_times = False  # final results carry every word's times (costs a little)
        self._reset_utterance(0)

    def _reset_utterance(self, position: int) -> None:
        self._audio = np.zeros(0, np.float32)
        self._offset = position  # stream position of _audio[0]
        self._agreement = LocalAgreement()
        self._earlier: list[HypWord] = []  # committed words before the window
        self._since_partial = 0
        self._partial: Job | None = None
        self._candidate: Job | None = None  # speculative final started at a pause
        self._candidate_at = -1  # ... for the end of speech at this position

    @property
    def committed(self) -> tuple[AsrWord, ...]:
        return tuple(_public(w) for w in (*self._earlier, *self._agreement.committed))

    def begin(self, position: int, preroll: npt.NDArray[np.int16] | None = None) -> None:
        """An utterance starts at ``position``; ``preroll`` is the audio just before it."""
        self.cancel()
        self._active = True
        pre = np.zeros(0, np.int16) if preroll is None else preroll
        self._reset_utterance(position - pre.size)
        self._audio = pcm16_to_float(pre)

    def push(self, samples: npt.NDArray[np.int16], partial: bool = True) -> None:
        """More of the utterance. ``partial`` False: no partial pass starts now (the
        caller's voice has stopped: the pause's speculative final will have the words;
        one due starts as soon as the voice resumes). A partial pass over the pause
        would hear only silence, and take a core from the reply being prepared: even at
        one session it would run beside the turn's score, the reply's first tokens and
        its first phrase's TTS. One started in the silence before the pause is announced
        covers too little of it to serve as the final (`COVER`), and the final queued
        behind it would wait a whole pass."""
        if samples.dtype != np.int16:
            raise TypeError(f"ASR takes int16 samples at 16 kHz, got {samples.dtype}")
        if not self._active:
            return
        self._audio = np.concatenate([self._audio, pcm16_to_float(samples)])
        self._since_partial += samples.size
        self._slide_window()
        if partial and self._since_partial >= self.partial_interval and self._partial is None:
            self._since_partial = 0
            self._start_partial()

    def pause(self, position: int, voiced_until: int | None = None) -> None:
        """The VAD saw a pause begin: the final pass of the utterance so far (audio to
        ``position``) starts speculatively. When the partial pass in flight already has
        `COVER` of audio past the words (``voiced_until``), it is taken as that final
        instead: it comes a whole pass sooner than one queued behind it."""
        if not self._active:
            return
        if self._candidate is not None and self._candidate is not self._partial:
            self._candidate.cancelled = True
        partial = self._partial
        if partial is not None and voiced_until is not None and partial.end >= voiced_until + COVER:
            self._candidate = partial
            self._queue.take_as_final(partial)
        else:
            self._candidate = self._submit(position, final=True)
        self._candidate_at = position

    async def finish(self, position: int) -> AsrResult:
        """End of speech at ``position``: the final result of the utterance."""
        if not self._active:
            return AsrResult("", (), True, position, 0.0)
        candidate, self._candidate = self._candidate, None
        job = candidate if candidate is not None and self._candidate_at == position else None
        if self._partial is not None and self._partial is not job:
            self._partial.cancelled = True  # superseded: its result would come after the final
        if job is None:
            if candidate is not None:
                candidate.cancelled = True
            job = self._submit(position, final=True)
        try:
            hyp = await job.future
        finally:
            self.cancel()
        words = [*job.earlier, *hyp.words]
        return AsrResult(_join(words), tuple(_public(w) for w in words), True, job.end, job.compute_ms)

    async def speculative(self) -> str | None:
        """The text of the speculative final started at the last pause, once ready (None
        if there is none, or it was dropped because the caller went on)."""
        job = self._candidate
        if job is None:
            return None
        await asyncio.wait([job.future])
        if job.future.cancelled() or job.future.exception() is not None or job.cancelled:
            return None
        return _join([*job.earlier, *job.future.result().words])

    async def idle(self) -> None:
        """Wait until no partial pass is pending (offline use: lockstep with the audio)."""
        while self._partial is not None:
            await asyncio.wait([self._partial.future])

    def cancel(self) -> None:
        """Drop the utterance in progress (barge-in, session end); idempotent."""
        for job in (self._partial, self._candidate):
            if job is not None:
                job.cancelled = True
                job.future.cancel()
        self._active = False
        self._partial = self._candidate = None

    def _submit(self, position: int, final: bool) -> Job:
        end = min(max(position, self._offset), self._offset + self._audio.size) - self._offset
        job = Job(self._audio[:end].copy(), self._offset, self._prefix(), final, self._loop)
        job.previous = self._previous_tokens()
        job.previous_keys = self._agreement.previous_keys()
        job.draft = self._agreement.draft()
        job.committed = len(self._agreement.committed)
        job.earlier = tuple(self._earlier)
        job.word_times = final and self.word_times
        self._queue.submit(job)
        return job

    def _prefix(self) -> list[int]:
        return [t for w in self._agreement.committed for t in w.tokens]

    def _previous_tokens(self) -> list[int]:
        return [t for w in self._earlier for t in w.tokens][-PREVIOUS_TEXT_TOKENS:]

    def _start_partial(self) -> None:
        job = self._submit(self._offset + self._audio.size, final=False)
        self._partial = job
        job.future.add_done_callback(lambda f: self._on_partial(job, f))

    def _on_partial(self, job: Job, future: asyncio.Future[Hypothesis]) -> None:
        if self._partial is job:
            self._partial = None
        if future.cancelled() or job.cancelled or not self._active or job.offset != self._offset:
            return  # stale: the window moved or the utterance ended meanwhile
        if future.exception() is not None:
            return  # logged by the engine; the next partial retries
        hyp = future.result()
        self._agreement.update(hyp.words, job.end)
        words = [*job.earlier, *hyp.words]
        result = AsrResult(_join(words), self.committed, False, job.end, job.compute_ms)
        if self.results.full():
            self.results.get_nowait()  # nobody reads: keep the newest
        self.results.put_nowait(result)
        self._slide_window()

    def _slide_window(self) -> None:
        """Move the window start to the last committed word once the window is long."""
        committed = self._agreement.committed
        if self._audio.size > self.window and committed and committed[-1].end > self._offset:
            cut = committed[-1].end - self._offset
            self._earlier.extend(committed)
            del self._earlier[:-MAX_UTTERANCE_WORDS]  # a monologue without end holds bounded memory
            self._agreement = LocalAgreement()
        elif self._audio.size > MAX_WINDOW:
            cut = self._audio.size - MAX_WINDOW // 2  # nothing agreed for 20 s: keep the newest half
        else:
            return
        self._audio = self._audio[cut:]
        self._offset += cut
        if self._partial is not None and self._partial is not self._candidate:
            self._partial.cancelled = True  # its words would not agree with the new window's
        self._partial = None  # (a speculative final stays right: its words and those before it)


def _public(word: HypWord) -> AsrWord:
    return AsrWord(word.text.strip(), word.start, word.end)


def _join(words: list[HypWord]) -> str:
    return "".join(w.text for w in words).strip()
