"""Streaming TTS: piper voices, one shared engine, per-session streams of 20 ms frames.

    text deltas ─► PhraseSplitter ─► phrase jobs ─┬► first-phrase thread (turns' first phrases)
                                                    └► later-phrase thread (the rest)
    TtsStream.frames() ◄─ WordMarks + AudioFrames (20 ms at the voice's rate) ◄─┘

A turn's first phrase is what the caller waits for; later phrases are ready long before
they play. Each kind has its own worker thread, so a first phrase never waits for a
later phrase being decoded (the two share the cores as the OS schedules them).

The voice runs in two parts (`models.voice_parts`): its first part gives a sentence's
latent frames and how many each phoneme lasts, the decoder turns frames into samples.
A turn's first phrase is decoded in spans, its first 186 ms alone, and each span goes
out as soon as it is decoded, when no other first phrase waits; other phrases are
decoded whole.

Word marks come from the phonemes' frames: a word is its phonemes between espeak's
spaces. Where espeak's words are not the text's (a number read out as two words), or
for a voice that cannot be split (run whole, as piper does), they are *estimated*: the
phrase's voiced span (its phonemes' span, or its audio's above -40 dB) is divided among
the words in proportion to their phoneme counts (each word phonemized alone by piper's
espeak-ng), with punctuation adding a pause's worth of weight. Phrases are short (a few
words to one sentence), which bounds the error to a fraction of a word; the boundaries
between phrases are exact.

Loudness: piper normalizes each sentence to full scale by default, which would make
loudness jump between phrases of a streamed reply; a fixed gain is used instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from audio_io.frame import AudioFrame
from audio_io.pcm import float_to_pcm16
from models.onnx_cpu import cpu_session
from models.phrases import Phrase, PhraseSplitter
from models.voice_parts import Encoded, VoiceParts, phoneme_spans, word_spans

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


# per word of a phrase: (char_start, char_end) within the phrase, (start, end) samples
Words = list[tuple[int, int, int, int]]


@dataclass(frozen=True)
class Synthesis:
    audio: npt.NDArray[np.int16]
    words: Words


@dataclass(frozen=True)
class Piece:
    """Part of a phrase's audio, in order; the first also says where its words are."""

    audio: npt.NDArray[np.int16]
    words: Words | None = None


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
# waits for the half on the core the LLM's engine core computes on, so a phrase beside
# one busy core (as in a session, the LLM decoding the rest of the reply) is slower on
# two threads than on one (figures: docs/performance.md, "The reply chain at one session").
TTS_THREADS = 1
FIRST_FRAMES = 16  # a first phrase's first span: 16 latent frames, 186 ms at 22.05 kHz


@dataclass
class _Lane:
    """One worker thread and its queue: turns' first phrases, or the rest."""

    name: str
    jobs: queue.Queue[_Job | None] = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None
    busy_s: float = 0.0  # synthesis time, for the real-time factor
    audio_s: float = 0.0

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class TtsEngine:
    """One piper voice, shared by all sessions; synthesis runs on two worker threads,
    one for turns' first phrases, one for the rest."""

    def __init__(self, voice_path: str | Path, deterministic: bool = False, split: bool = True) -> None:
        from piper import PiperConfig, PiperVoice, SynthesisConfig

        config = PiperConfig.from_dict(json.loads(Path(f"{voice_path}.json").read_text(encoding="utf-8")))
        # in two parts if it splits (``split=False``: whole, as piper runs it)
        self.parts = VoiceParts.load(voice_path, config.hop_length, TTS_THREADS) if split else None
        whole = cpu_session(voice_path, TTS_THREADS) if self.parts is None else None
        self.voice = PiperVoice(config=config, session=whole)  # (phonemes and ids only, when split)
        self.name = Path(voice_path).name.removesuffix(".onnx")  # e.g. en_US-joe-medium
        self.sample_rate: int = self.voice.config.sample_rate
        self.frame_samples = self.sample_rate // 50
        # piper's generator noise makes every synthesis differ; tests want repeatable audio
        noise = 0.0 if deterministic else None
        self._syn_config = SynthesisConfig(normalize_audio=False, noise_scale=noise, noise_w_scale=noise)
        self._scales = np.array(
            [
                config.noise_scale if noise is None else noise,
                config.length_scale,
                config.noise_w_scale if noise is None else noise,
            ],
            dtype=np.float32,
        )
        self._espeak = threading.Lock()
        self._first, self._later = _Lane("first"), _Lane("later")
        self._lanes = (self._first, self._later)
        for lane in self._lanes:
            self._start(lane)

    def _start(self, lane: _Lane) -> None:
        lane.thread = threading.Thread(target=self._work, args=(lane,), name=f"tts-{lane.name}", daemon=True)
        lane.thread.start()

    @property
    def busy_s(self) -> float:
        """Synthesis time so far, for the real-time factor."""
        return sum(lane.busy_s for lane in self._lanes)

    @property
    def audio_s(self) -> float:
        return sum(lane.audio_s for lane in self._lanes)

    @property
    def alive(self) -> bool:
        return all(lane.alive for lane in self._lanes)

    def restart(self) -> int:
        """Start a new worker for each one that died; how many. The queues are kept: the
        phrases waiting in them are synthesized by the new workers."""
        dead = [lane for lane in self._lanes if not lane.alive]
        for lane in dead:
            self._start(lane)
        return len(dead)

    def close(self) -> None:
        """Stop the workers after the phrases in progress; idempotent."""
        for lane in self._lanes:
            if lane.alive:
                lane.jobs.put(None)
        for lane in self._lanes:  # both told first: they finish their phrases side by side
            if lane.thread is not None:
                lane.thread.join(timeout=5)

    def stream(self, splitter: PhraseSplitter | None = None) -> TtsStream:
        return TtsStream(self, splitter or PhraseSplitter())

    # -- synthesis (worker thread) --

    def synthesize(self, text: str) -> Synthesis:
        """Blocking: one phrase to int16 audio and its words' spans."""
        pieces = list(self.pieces(text))
        return Synthesis(np.concatenate([p.audio for p in pieces]), pieces[0].words or [])

    def pieces(
        self, text: str, first_frames: int | None = None, stop: threading.Event | None = None
    ) -> Iterator[Piece]:
        """Blocking: one phrase's audio in pieces, the first with the words' spans; with
        ``first_frames``, its first sentence's first frames are a piece of their own.
        Once ``stop`` is set, no more is decoded."""
        if self.parts is None:
            with self._espeak:  # piper phonemizes inside
                chunks = [c.audio_float_array for c in self.voice.synthesize(text, self._syn_config)]
            audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            yield Piece(self._pcm(audio), self._estimate_words(text, *voiced_span(audio, self.sample_rate)))
            return
        parts = self.parts
        sentences = [
            (ph, parts.encode(self.voice.phonemes_to_ids(ph), self._scales))
            for ph in self._phonemize(text)
            if ph
        ]
        words: Words | None = self._words(text, sentences)
        for i, (_, encoded) in enumerate(sentences):
            for start, end in parts.spans(encoded, first_frames if i == 0 else None):
                if stop is not None and stop.is_set():
                    return
                yield Piece(self._pcm(parts.decode(encoded, start, end)), words)
                words = None
        if words is not None:  # nothing to say
            yield Piece(np.zeros(0, np.int16), words)

    def _phonemize(self, text: str) -> list[list[str]]:
        with self._espeak:  # espeak-ng keeps its state in globals: one caller at a time
            return self.voice.phonemize(text)

    @staticmethod
    def _pcm(audio: npt.NDArray[np.float32]) -> npt.NDArray[np.int16]:
        """piper's float samples, clipped as piper clips them, at the fixed gain."""
        return float_to_pcm16(np.clip(np.clip(audio, -1.0, 1.0) * FIXED_GAIN, -1.0, 1.0))

    def _words(self, text: str, sentences: list[tuple[list[str], Encoded]]) -> Words:
        """Each word's samples from its phonemes' frames; estimated over the phonemes'
        span where espeak's words are not the text's."""
        assert self.parts is not None
        hop, id_map = self.parts.hop, self.voice.config.phoneme_id_map
        spans: list[tuple[int, int]] = []
        offset = 0
        for phonemes, encoded in sentences:
            aligned = phoneme_spans(phonemes, id_map, encoded.id_frames, hop)
            if aligned is None:
                return self._estimate_words(text, 0, sum(e.frames for _, e in sentences) * hop)
            spans += [(offset + a, offset + b) for a, b in word_spans(aligned)]
            offset += encoded.frames * hop
        words = list(_WORD.finditer(text))
        if len(spans) == len(words):
            return [(w.start(), w.end(), a, b) for w, (a, b) in zip(words, spans, strict=True)]
        return self._estimate_words(text, spans[0][0] if spans else 0, spans[-1][1] if spans else offset)

    def _estimate_words(self, text: str, start: int, end: int) -> Words:
        """The span ``[start, end)`` divided among the words by their phoneme counts."""
        words = list(_WORD.finditer(text))
        if not words:
            return []
        weights = []
        for w in words:
            phonemes = [p for sentence in self._phonemize(w.group()) for p in sentence]
            core = sum(1 for p in phonemes if p not in _STRESS and not p.isspace() and p not in _PAUSE_WEIGHT)
            weights.append(max(core, 1) + _PAUSE_WEIGHT.get(w.group()[-1], 0.0))
        edges = start + (end - start) * np.concatenate([[0.0], np.cumsum(weights)]) / sum(weights)
        bounds = np.rint(edges).astype(int)
        return [(w.start(), w.end(), int(bounds[i]), int(bounds[i + 1])) for i, w in enumerate(words)]

    def _work(self, lane: _Lane) -> None:
        while True:
            job = lane.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            started = time.perf_counter()
            # A first phrase in spans only while no other first phrase waits: spans cost
            # more (context around each), and under load the next span, behind other
            # sessions' work, comes too late and leaves a gap in the reply (figures:
            # docs/performance.md, "The first phrase's audio in pieces")
            spans = FIRST_FRAMES if job.first and lane.jobs.empty() else None
            try:  # a cut (job.cancelled) stops the phrase's decoding
                for piece in self.pieces(job.text, spans, job.cancelled):
                    job.deliver(piece)
                    lane.audio_s += piece.audio.size / self.sample_rate
            except Exception as e:  # a bad phrase fails its stream, not the engine
                log.exception("synthesis failed for a phrase of %d chars", len(job.text))
                job.deliver(e)
            except BaseException:  # the worker ends (the engine watch starts another): the phrase fails
                job.deliver(RuntimeError("the TTS worker stopped during this phrase"))
                raise
            finally:
                lane.busy_s += time.perf_counter() - started
            job.deliver(None)

    def submit(self, job: _Job) -> None:
        (self._first if job.first else self._later).jobs.put(job)


@dataclass(eq=False)
class _Job:
    """One phrase: its pieces go from the worker to the stream, then None."""

    text: str
    first: bool  # the turn's first phrase
    loop: asyncio.AbstractEventLoop
    pieces: asyncio.Queue[Piece | BaseException | None] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def deliver(self, item: Piece | BaseException | None) -> None:
        """From the worker thread (a closed loop: nobody is waiting any more)."""
        try:
            self.loop.call_soon_threadsafe(self.pieces.put_nowait, item)
        except RuntimeError:
            pass

    def cancel(self) -> None:
        """On the loop: the stream stops waiting, the worker stops decoding it."""
        self.cancelled.set()
        self.pieces.put_nowait(None)


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
            job.cancel()
        while not self._jobs.empty():
            self._jobs.get_nowait()
        self._jobs.put_nowait(None)

    def _submit(self, phrases: list[Phrase]) -> None:
        for phrase in phrases:
            job = _Job(phrase.text, phrase.index == 0, self._loop)
            self._all_jobs.append(job)
            self.engine.submit(job)
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
            start = position  # of the phrase in the turn's audio
            while (piece := await job.pieces.get()) is not None and not self.cancelled:
                if isinstance(piece, BaseException):
                    raise piece
                for c0, c1, s0, s1 in piece.words or ():
                    yield WordMark(phrase.char_start + c0, phrase.char_start + c1, start + s0, start + s1)
                position += piece.audio.size
                carry = np.concatenate([carry, piece.audio])
                while carry.size >= n and not self.cancelled:
                    yield AudioFrame(carry[:n].copy(), self.engine.sample_rate)
                    carry = carry[n:]
        if not self.cancelled and carry.size:
            yield AudioFrame(
                np.concatenate([carry, np.zeros(n - carry.size, np.int16)]), self.engine.sample_rate
            )
