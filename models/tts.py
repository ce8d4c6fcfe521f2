"""Streaming TTS: piper voices, one shared engine, per-session streams of 20 ms frames.

    text deltas ─► PhraseSplitter ─► phrase jobs ─► engine thread (piper, one at a time,
                                                    first phrases before later ones)
    TtsStream.frames() ◄─ WordMarks + AudioFrames (20 ms at the voice's rate) ◄─┘

Word marks are *estimated*: the bundled joe-medium voice has no duration output, so
piper cannot report alignments. Within each synthesized phrase, the voiced span (the
audio between the leading and trailing silence, found by energy) is divided among the
words in proportion to their phoneme counts (each word phonemized alone by piper's
espeak-ng), with punctuation adding a pause's worth of weight. Phrases are short
(a few words to one sentence), which bounds the error to a fraction of a word; the
boundaries between phrases are exact.

Loudness: piper normalizes each sentence to full scale by default, which would make
loudness jump between phrases of a streamed reply; a fixed gain is used instead.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from audio_io.frame import AudioFrame
from audio_io.pcm import float_to_pcm16
from models.handoff import resolve_from_thread
from models.onnx_cpu import cpu_session
from models.phrases import Phrase, PhraseSplitter

log = logging.getLogger("duplex.tts")

_WORD = re.compile(r"\S+")
_STRESS = set("ˈˌ")
_PAUSE_WEIGHT = {",": 2.0, ";": 3.0, ":": 3.0, ".": 4.0, "!": 4.0, "?": 4.0}
FIXED_GAIN = 1.6  # raw VITS output of the bundled voice peaks near 0.5


@dataclass(frozen=True)
class WordMark:
    """``text[char_start:char_end]`` of the turn is spoken in samples
    ``[sample_start, sample_end)`` of the turn's audio, at the voice's rate."""

    char_start: int
    char_end: int
    sample_start: int
    sample_end: int


@dataclass(frozen=True)
class Synthesis:
    audio: npt.NDArray[np.int16]
    # per word of the phrase: (char_start, char_end) within the phrase, (start, end) samples
    words: list[tuple[int, int, int, int]]


def voiced_span(audio: npt.NDArray[np.float32], rate: int) -> tuple[int, int]:
    """First and last sample above -40 dB of the peak, in 10 ms hops."""
    hop = rate // 100
    if audio.size < hop:
        return 0, audio.size
    frames = audio[: audio.size // hop * hop].reshape(-1, hop)
    energy = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    loud = np.nonzero(energy > energy.max() * 0.01)[0]
    if loud.size == 0:
        return 0, audio.size
    return int(loud[0] * hop), int(min(audio.size, (loud[-1] + 1) * hop))


# One onnxruntime thread: with two, each of piper's ops is split across both cores, and
# waits for the half on the core the LLM's engine core computes on. A two-word phrase
# took 57 ms idle, but 127-144 ms beside one busy core (as in a session, the LLM
# decoding the rest of the reply); with one thread, 80 ms idle and 75-90 ms beside it
# (AMD EPYC Zen 4, 2 cores, no AMX).
TTS_THREADS = 1


class TtsEngine:
    """One piper voice, shared by all sessions; synthesis runs on one worker thread."""

    def __init__(self, voice_path: str | Path, deterministic: bool = False) -> None:
        from piper import PiperConfig, PiperVoice, SynthesisConfig

        config = PiperConfig.from_dict(json.loads(Path(f"{voice_path}.json").read_text(encoding="utf-8")))
        self.voice = PiperVoice(config=config, session=cpu_session(voice_path, TTS_THREADS))
        self.name = Path(voice_path).name.removesuffix(".onnx")  # e.g. en_US-joe-medium
        self.sample_rate: int = self.voice.config.sample_rate
        self.frame_samples = self.sample_rate // 50
        # piper's generator noise makes every synthesis differ; tests want repeatable audio
        noise = 0.0 if deterministic else None
        self._syn_config = SynthesisConfig(normalize_audio=False, noise_scale=noise, noise_w_scale=noise)
        self._jobs: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self.busy_s = 0.0  # synthesis time, for the real-time factor
        self.audio_s = 0.0
        self._thread = self._worker()

    def _worker(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name="tts-engine", daemon=True)
        thread.start()
        return thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def restart(self) -> int:
        """Start a new worker if the one there was died (1), else nothing (0). The queue
        is kept: the phrases waiting in it are synthesized by the new worker."""
        if self._thread.is_alive():
            return 0
        self._thread = self._worker()
        return 1

    def close(self) -> None:
        """Stop the worker after the phrase in progress; idempotent."""
        if self._thread.is_alive():
            self._jobs.put((-1, next(self._seq), None))
            self._thread.join(timeout=5)

    def stream(self, splitter: PhraseSplitter | None = None) -> TtsStream:
        return TtsStream(self, splitter or PhraseSplitter())

    # -- synthesis (worker thread) --

    def synthesize(self, text: str) -> Synthesis:
        """Blocking: one phrase to int16 audio and estimated word spans."""
        chunks = list(self.voice.synthesize(text, self._syn_config))
        audio = np.concatenate([c.audio_float_array for c in chunks]) if chunks else np.zeros(0, np.float32)
        audio = np.clip(audio * FIXED_GAIN, -1.0, 1.0)
        return Synthesis(float_to_pcm16(audio), self._estimate_words(text, audio))

    def _estimate_words(self, text: str, audio: npt.NDArray[np.float32]) -> list[tuple[int, int, int, int]]:
        words = list(_WORD.finditer(text))
        if not words:
            return []
        weights = []
        for w in words:
            phonemes = [p for sentence in self.voice.phonemize(w.group()) for p in sentence]
            core = sum(1 for p in phonemes if p not in _STRESS and not p.isspace() and p not in _PAUSE_WEIGHT)
            weights.append(max(core, 1) + _PAUSE_WEIGHT.get(w.group()[-1], 0.0))
        start, end = voiced_span(audio, self.sample_rate)
        edges = start + (end - start) * np.concatenate([[0.0], np.cumsum(weights)]) / sum(weights)
        bounds = np.rint(edges).astype(int)
        return [(w.start(), w.end(), int(bounds[i]), int(bounds[i + 1])) for i, w in enumerate(words)]

    def _work(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            started = time.perf_counter()
            result: Synthesis | BaseException
            try:
                result = self.synthesize(job.text)
                self.busy_s += time.perf_counter() - started
                self.audio_s += result.audio.size / self.sample_rate
            except Exception as e:  # a bad phrase fails its stream, not the engine
                log.exception("synthesis failed for a phrase of %d chars", len(job.text))
                result = e
            except BaseException:  # the worker ends (the engine watch starts another): the phrase fails
                job.deliver(RuntimeError("the TTS worker stopped during this phrase"))
                raise
            job.deliver(result)

    def submit(self, job: _Job, first: bool) -> None:
        # First phrases of a turn jump ahead of later phrases of other turns.
        self._jobs.put((0 if first else 1, next(self._seq), job))


@dataclass(eq=False)
class _Job:
    text: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Synthesis] = field(init=False)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()

    def deliver(self, result: Synthesis | BaseException) -> None:
        resolve_from_thread(self.loop, self.future, result)


class TtsStream:
    """One assistant turn: text deltas in, word marks and 20 ms frames out, in order.

    `cancel` is synchronous: after it returns, `frames` yields nothing more, and
    phrases not yet synthesized are dropped from the engine's queue.
    """

    def __init__(self, engine: TtsEngine, splitter: PhraseSplitter) -> None:
        self.engine = engine
        self._splitter = splitter
        self._loop = asyncio.get_running_loop()
        self._jobs: asyncio.Queue[tuple[Phrase, _Job] | None] = asyncio.Queue()
        self._all_jobs: list[_Job] = []
        self._ended = False
        self.cancelled = False

    @property
    def text(self) -> str:
        return self._splitter.text

    def push_text(self, delta: str) -> list[Phrase]:
        """Add LLM text; returns the phrases this completed (now queued for synthesis)."""
        assert not self._ended, "push_text after end_text"
        if self.cancelled:
            return []
        phrases = self._splitter.push(delta)
        self._submit(phrases)
        return phrases

    def end_text(self) -> list[Phrase]:
        """No more text: the rest is the last phrase (returned, if any)."""
        if self._ended:
            return []
        self._ended = True
        phrases = [] if self.cancelled else self._splitter.flush()
        self._submit(phrases)
        self._jobs.put_nowait(None)
        return phrases

    def cancel(self) -> None:
        self.cancelled = True
        for job in self._all_jobs:
            job.cancelled.set()
            job.future.cancel()
        while not self._jobs.empty():
            self._jobs.get_nowait()
        self._jobs.put_nowait(None)

    def _submit(self, phrases: list[Phrase]) -> None:
        for phrase in phrases:
            job = _Job(phrase.text, self._loop)
            self._all_jobs.append(job)
            self.engine.submit(job, first=phrase.index == 0)
            self._jobs.put_nowait((phrase, job))

    async def frames(self) -> AsyncIterator[AudioFrame | WordMark]:
        """Marks of each phrase, then its frames; the last frame is zero-padded."""
        n = self.engine.frame_samples
        carry = np.zeros(0, dtype=np.int16)
        position = 0  # samples of this turn yielded or carried so far
        while not self.cancelled:
            item = await self._jobs.get()
            if item is None or self.cancelled:
                break
            phrase, job = item
            try:
                synthesis = await job.future
            except asyncio.CancelledError:
                if self.cancelled:
                    break
                raise
            if self.cancelled:
                break
            for c0, c1, s0, s1 in synthesis.words:
                yield WordMark(phrase.char_start + c0, phrase.char_start + c1, position + s0, position + s1)
            position += synthesis.audio.size
            carry = np.concatenate([carry, synthesis.audio])
            while carry.size >= n and not self.cancelled:
                yield AudioFrame(carry[:n].copy(), self.engine.sample_rate)
                carry = carry[n:]
        if not self.cancelled and carry.size:
            yield AudioFrame(
                np.concatenate([carry, np.zeros(n - carry.size, np.int16)]), self.engine.sample_rate
            )
