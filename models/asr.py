"""Streaming ASR: Whisper (CTranslate2 via faster-whisper), one engine for all sessions.

Whisper's encoder expects 30 s of audio; padding every pass to 30 s costs ~0.3 s of
encoder time here, whatever the utterance length. Instead each pass encodes only the
utterance (plus 0.3 s of silence) and completes the encoder output to Whisper's 1,500
positions with the encoder states of 30 s of silence, computed once at start-up. The
decoder then sees what it was trained on: speech followed by silence. Measured here
(tiny.en, int8, one thread): a 3 s utterance encodes in ~15 ms instead of ~290 ms. What
did not work: truncating the encoder output to the audio (or to audio plus 5-15 s of
silence states) makes the decoder loop ("What time is it? What time is it? ...") on
short utterances; only the full 1,500 positions were reliable on our test phrases.
The decoder is our own (`models.whisper_decoder`): the silence positions' share of its
cross-attention is computed once, not on every pass as CTranslate2's decoder does.

While the caller speaks, a partial pass runs every ``partial_interval`` of new audio
(none starts in a pause the VAD announced: the speculative final has the words).
Words two consecutive passes agree on are committed (`LocalAgreement`) and forced as
the decoder prefix of every later pass, so they are never retracted. When the VAD
reports a pause, the final pass of the utterance so far starts at once (or the partial
pass in flight serves as it, if it already heard `COVER` past the last word: one pass
sooner); if the pause becomes the end of the turn, that pass is the final and is usually
done before the end-of-speech event; if speech resumes it is discarded.

Worker threads (one by default; ``workers`` for machines with cores to spare) serve
every stream: finals before partials, at most one pending partial per stream, so under
load partials get rarer and finals are never dropped. Model compute never runs on
the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from audio_io.pcm import RUNTIME_RATE, pcm16_to_float
from models.agreement import HypWord, LocalAgreement, word_key
from models.handoff import cancel_from_thread, resolve_from_thread
from models.whisper_decoder import WhisperDecoder

log = logging.getLogger("duplex.asr")

SAMPLE_RATE = RUNTIME_RATE
WINDOW_S = 30
TAIL_PAD = int(0.3 * SAMPLE_RATE)
MAX_WINDOW = 20 * SAMPLE_RATE  # with nothing committed for this long, keep only the newest half
MAX_UTTERANCE_WORDS = 600  # ~3,600 characters, what one user turn can hold: longer keeps the newest
PREVIOUS_TEXT_TOKENS = 48  # context from before the window, as Whisper's previous-text prompt
NO_SPEECH_THRESHOLD = 0.6
MAX_BATCH = 4  # finals of different streams decoded together (transcribe_batch)


MAX_DECODE_TOKENS = 448  # Whisper's decoder context
WINDOW = WINDOW_S * SAMPLE_RATE - TAIL_PAD  # one pass of a one-shot transcription
COVER = SAMPLE_RATE // 10  # audio past the last word that lets a partial pass serve as the final


def limit_blas_threads() -> None:
    """One BLAS thread for numpy in this process.

    faster-whisper computes log-mel features with numpy; OpenBLAS then keeps a second
    thread spinning after each call. Measured here: a pass took the same wall time
    but twice the CPU time (56 ms CPU for 32 ms wall) until OpenBLAS was held to one
    thread (28 ms for 28 ms). Our numpy work is small; model compute has its own
    thread settings (CTranslate2 ``cpu_threads``, onnxruntime, vLLM's processes).
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


class AsrClosed(RuntimeError):
    """A pass asked of, or left unfinished by, a closed engine (the server is stopping)."""


@dataclass(frozen=True)
class AsrWord:
    text: str
    start: int  # stream sample positions (16 kHz)
    end: int


@dataclass(frozen=True)
class AsrResult:
    text: str  # the whole utterance as heard so far (final: as heard)
    committed: tuple[AsrWord, ...]  # words that will not change
    final: bool
    audio_end: int  # stream position of the last sample this pass saw
    compute_ms: float


@dataclass(frozen=True)
class _Hypothesis:
    words: list[HypWord]
    text: str
    tokens: list[int] = field(default_factory=list)
    offset: int = 0
    encoded: npt.NDArray[np.float32] | None = None  # the audio's encoder states, for word times
    frames: int = 0


class AsrEngine:
    def __init__(
        self,
        model_path: str | Path,
        compute_type: str = "int8",
        cpu_threads: int = 1,
        device: str = "cpu",
        workers: int = 1,
    ) -> None:
        import ctranslate2
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        limit_blas_threads()
        self._ct2 = ctranslate2
        self.model = WhisperModel(
            str(model_path),
            device=device,
            compute_type=compute_type,
            cpu_threads=cpu_threads,
            num_workers=workers,  # CTranslate2 model replicas: passes that may run at once
        )
        self.tokenizer = Tokenizer(
            self.model.hf_tokenizer, self.model.model.is_multilingual, task="transcribe", language="en"
        )
        self._prompt = [*self.tokenizer.sot_sequence, self.tokenizer.no_timestamps]
        silence = self.model.feature_extractor(np.zeros(WINDOW_S * SAMPLE_RATE, np.float32), padding=0)
        self._silence_states = self._encode(silence[:, : self.model.feature_extractor.nb_max_frames])
        tokenizer = self.tokenizer
        self.decoder = WhisperDecoder(
            Path(model_path),
            self._silence_states,
            eot=tokenizer.eot,
            no_timestamps=tokenizer.no_timestamps,
            sot=tokenizer.sot,
            no_speech=tokenizer.no_speech,
        )
        self._jobs: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self.passes = 0
        self.batches = 0  # decoder calls: passes decoded together count once
        self.finals_from_partials = 0  # pauses whose final was the partial pass in flight
        self.finals_ahead = 0  # final batches run in the middle of a partial pass (`_run`)
        self.busy_s = 0.0  # worker time spent in passes
        self._counter_lock = threading.Lock()
        self._running: set[_Job] = set()  # the passes the workers are running (under the lock)
        self._threads = [self._worker(i) for i in range(workers)]

    def _worker(self, i: int) -> threading.Thread:
        thread = threading.Thread(target=self._work, name=f"asr-engine-{i}", daemon=True)
        thread.start()
        return thread

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

    def close(self, timeout: float = 1.0) -> None:
        """Stop the workers after the passes in progress, waiting at most ``timeout`` s
        for them all (a long pass is left to finish in its daemon thread: shutdown must
        not wait for a 30 s window); idempotent. Every pass that will not complete by
        then, queued or in progress, fails at once: nobody waits on a closed engine."""
        closed = AsrClosed("the ASR engine is closed")
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item[2] is not None:
                item[2].deliver(closed)
        for _ in self._threads:
            self._jobs.put((-1, next(self._seq), None))
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._counter_lock:
            running = list(self._running)
        for job in running:  # a long pass left to finish: its result comes to nobody
            job.deliver(closed)

    # -- passes (worker thread, or any thread for one-shot use) --

    def _encode(self, features: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        view = self._ct2.StorageView.from_array(np.ascontiguousarray(features[None]))
        return np.array(self.model.model.encode(view, to_cpu=True))

    def transcribe_window(
        self,
        audio: npt.NDArray[np.float32],
        offset: int,
        prefix: list[int],
        word_times: bool,
        previous: list[int] | None = None,
    ) -> _Hypothesis:
        """One pass over at most 30 s of 16 kHz audio, continuing ``prefix`` tokens."""
        (hyp,) = self.transcribe_batch([_Window(audio, offset, prefix, previous or [])])
        return self.with_times(hyp) if word_times and hyp.tokens else hyp

    def encode_audio(self, audio: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.float32], int]:
        """The encoder states of the audio alone (with `TAIL_PAD` of silence), and its feature frames."""
        features = self.model.feature_extractor(
            np.concatenate([audio, np.zeros(TAIL_PAD, np.float32)]), padding=0
        )
        frames = features.shape[-1] - features.shape[-1] % 2
        return self._encode(features[:, :frames])[0], frames

    def completed(self, encoded: npt.NDArray[np.float32]) -> object:
        """The audio's encoder states completed to Whisper's 1,500 positions with the
        silence's, as CTranslate2 takes them."""
        states = np.concatenate([encoded[None], self._silence_states[:, encoded.shape[0] :]], axis=1)
        return self._ct2.StorageView.from_array(np.ascontiguousarray(states))

    def transcribe_batch(
        self, windows: list[_Window], between: Callable[[], None] | None = None
    ) -> list[_Hypothesis]:
        """One pass over each window, decoded together (`WhisperDecoder`). Measured with
        our decoder (tiny.en, one thread, AMD EPYC family 23 model 1, AVX2): the decode of
        4 windows of 2-5 s, 534 ms one by one, 478 ms together, the same tokens (705 ms
        together while a few rows went through OpenBLAS's matrix product,
        `whisper_decoder.ROW_BY_ROW`). Without word times (`with_times` adds them to one).
        ``between`` is called once the audio is encoded and before each decoding step."""
        out = [_Hypothesis([], "")] * len(windows)  # too short or silent: no words
        passes: list[tuple[int, npt.NDArray[np.float32], list[int], int]] = []
        for i, w in enumerate(windows):
            assert w.audio.size <= (WINDOW_S * SAMPLE_RATE) - TAIL_PAD, "window longer than Whisper's 30 s"
            if w.audio.size < SAMPLE_RATE // 10 or not np.any(w.audio):
                continue
            encoded, frames = self.encode_audio(w.audio)
            passes.append((i, encoded, self.prompt(w.previous) + w.prefix, frames))
        if not passes:
            return out
        if between is not None:
            between()
        # max_length counts the prompt, as CTranslate2's (a long previous text without it left no room at all)
        decoded = self.decoder.generate(
            [
                (e, p, min(MAX_DECODE_TOKENS, len(p) + int(8 * windows[i].audio.size / SAMPLE_RATE) + 16))
                for i, e, p, _ in passes
            ],
            [windows[i].draft for i, _, _, _ in passes],
            between,
        )
        for (i, encoded, _, frames), result in zip(passes, decoded, strict=True):
            if result.no_speech_prob is not None and result.no_speech_prob > NO_SPEECH_THRESHOLD:
                continue
            tokens = [t for t in result.tokens if t < self.tokenizer.eot]
            text = self.tokenizer.decode(tokens).strip()
            hyp = _Hypothesis([], text, tokens, windows[i].offset, encoded, frames)
            out[i] = replace(hyp, words=self._words(hyp, times=False))
        return out

    def prompt(self, previous: list[int]) -> list[int]:
        """Decoder prompt: earlier text of the utterance (if any), then the task tokens."""
        context = [self.tokenizer.sot_prev, *previous[-PREVIOUS_TEXT_TOKENS:]] if previous else []
        return context + self._prompt

    def with_times(self, hyp: _Hypothesis) -> _Hypothesis:
        """Add word timestamps (cross-attention alignment, ~25 ms a pass here)."""
        return replace(hyp, words=self._words(hyp, times=True))

    def _words(self, hyp: _Hypothesis, times: bool) -> list[HypWord]:
        tokens, offset = hyp.tokens, hyp.offset
        if not tokens:
            return []
        if times:
            assert hyp.encoded is not None
            aligned = self.model.find_alignment(
                self.tokenizer, [tokens], self.completed(hyp.encoded), hyp.frames
            )[0]
            spans = [(w["word"], tuple(w["tokens"]), w["start"], w["end"]) for w in aligned]
        else:
            texts, word_tokens = self.tokenizer.split_to_word_tokens(tokens + [self.tokenizer.eot])
            spans = [
                (t, tuple(ts), 0.0, 0.0)
                for t, ts in zip(texts, word_tokens, strict=True)
                if ts != [self.tokenizer.eot]
            ]
        words: list[HypWord] = []
        for text, toks, start, end in spans:
            s, e = offset + int(start * SAMPLE_RATE), offset + int(end * SAMPLE_RATE)
            if words and not text.startswith(" ") and not text[:1].isalnum():
                last = words[-1]  # punctuation belongs to the word before it
                words[-1] = HypWord(last.text + text, last.tokens + toks, last.start, max(last.end, e))
            else:
                words.append(HypWord(text, toks, s, e))
        return words

    def transcribe(self, samples: npt.NDArray[np.int16]) -> str:
        """One-shot transcription of any length (30 s windows cut at committed words),
        on the calling thread: for tools. A session's utterance goes through the worker
        queue instead (`transcribe_queued`)."""
        audio, parts, start = pcm16_to_float(samples), [], 0
        while start < audio.size:
            last = start + WINDOW >= audio.size
            hyp = self.transcribe_window(audio[start : start + WINDOW], start, [], word_times=not last)
            text, start = (hyp.text, audio.size) if last else _cut(hyp, start)
            parts.append(text)
        return " ".join(p for p in parts if p)

    async def transcribe_queued(self, samples: npt.NDArray[np.int16]) -> str:
        """`transcribe`, each window a final pass on the worker queue: it waits its turn
        behind other sessions' finals, ahead of their partials, off the event loop."""
        audio, parts, start = pcm16_to_float(samples), [], 0
        while start < audio.size:
            last = start + WINDOW >= audio.size
            job = _Job(audio[start : start + WINDOW], start, [], True, asyncio.get_running_loop())
            job.word_times = not last
            self.submit(job)
            try:
                hyp = await job.future
            finally:
                job.cancelled = True  # a cancelled wait: the worker skips it if not begun
            text, start = (hyp.text, audio.size) if last else _cut(hyp, start)
            parts.append(text)
        return " ".join(p for p in parts if p)

    # -- the worker --

    def submit(self, job: _Job) -> None:
        self._jobs.put((0 if job.final else 1, next(self._seq), job))

    def _take(self) -> list[_Job] | None:
        """The next passes to run: the first in the queue (finals before partials), and,
        for a final, the finals already waiting behind it, up to `MAX_BATCH` (None: stop).
        Partials run one at a time: batched, they kept the next final waiting for the
        whole batch (voice-to-voice p50 at 8 sessions 1,425-1,663 ms, against 1,247-1,321
        without batching; AMD EPYC Zen 4, 2 cores, no AMX)."""
        first = self._jobs.get()
        if first[2] is None:
            return None
        return self._batch(first)

    def _batch(self, first: tuple[int, int, _Job | None]) -> list[_Job]:
        assert first[2] is not None
        jobs = [first[2]]
        while first[0] == 0 and len(jobs) < MAX_BATCH:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item[2] is None or item[0] != first[0]:  # a stop, or a partial
                self._jobs.put(item)
                break
            jobs.append(item[2])
        return [job for job in jobs if not job.cancelled]

    def _finals_waiting(self) -> list[_Job] | None:
        """The finals at the head of the queue, batched as `_take` does (cancelled ones
        left out); None when the head is no final."""
        with self._jobs.mutex:  # a look first: most steps find no final
            if not self._jobs.queue or self._jobs.queue[0][0] != 0:
                return None
        try:
            first = self._jobs.get_nowait()
        except queue.Empty:
            return None
        if first[0] != 0:  # another worker took the final meanwhile
            self._jobs.put(first)
            return None
        return self._batch(first)

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        """One pass over ``jobs``, its results delivered. A partial pass lets the finals
        that come meanwhile run first, between its decoding steps (`transcribe_batch`'s
        ``between``), so that a final waits a step and not the rest of a pass: at 8
        sessions (Intel Xeon, AMX) finals waited 55 ms p50 (147 p90) for the pass ahead,
        partials taking 109 ms. A partial taken as a pause's final does not yield: it is
        that final. A pass whose every request was cancelled meanwhile (a partial its
        stream's final superseded) stops at its next step, its futures cancelled."""
        started = time.perf_counter()
        yielded = 0.0  # time the finals run ahead took, not this pass's

        def finals_first() -> None:
            nonlocal yielded
            if not any(job.final or job.taken_as_final for job in jobs):
                began = time.perf_counter()
                while (finals := self._finals_waiting()) is not None:
                    if finals:
                        with self._counter_lock:
                            self.finals_ahead += 1
                        self._run(finals)
                yielded += time.perf_counter() - began
            if all(job.cancelled for job in jobs):
                raise _Superseded("every request of this pass was cancelled while it ran")

        with self._counter_lock:
            self._running.update(jobs)
        results: list[_Hypothesis | BaseException] | None  # None: dropped, nobody waits for it
        try:
            windows = [_Window(j.audio, j.offset, j.prefix, j.previous, j.draft) for j in jobs]
            hypotheses = self.transcribe_batch(windows, finals_first)
            finals_first()
            # Word times only matter for words about to be committed: align only
            # when this pass agrees with the previous one beyond what is committed.
            # A final pass aligns only when its stream asks for word times: it costs
            # 25-65 ms (measured here for 2-5 s utterances), on the turn's critical path.
            results = [
                self.with_times(h) if h.tokens and (j.word_times if j.final else j.may_commit(h.words)) else h
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
            with self._counter_lock:
                self._running.difference_update(jobs)
        elapsed = time.perf_counter() - started - yielded
        with self._counter_lock:
            self.passes += len(jobs)
            self.batches += 1
            self.busy_s += elapsed
        for i, job in enumerate(jobs):
            job.compute_ms = elapsed * 1000
            if results is None:
                job.drop()
            else:
                job.deliver(results[i])


class _Superseded(Exception):
    """A pass stopped between its steps: its requests were all cancelled meanwhile."""


@dataclass(frozen=True)
class _Window:
    """What one pass transcribes: audio from stream position ``offset``, continuing the
    committed ``prefix`` tokens, with ``previous`` text from before the window."""

    audio: npt.NDArray[np.float32]
    offset: int
    prefix: list[int]
    previous: list[int]
    draft: list[int] = field(default_factory=list)  # tokens the text may go on with (the last pass's)


@dataclass(eq=False)
class _Job:
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
    future: asyncio.Future[_Hypothesis] = field(init=False)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()

    def may_commit(self, words: list[HypWord]) -> bool:
        """Would this pass commit a word? (Then it is worth aligning for word times.)"""
        i = self.committed
        return i < min(len(words), len(self.previous_keys)) and word_key(words[i]) == self.previous_keys[i]

    @property
    def end(self) -> int:
        return self.offset + self.audio.size

    def deliver(self, result: _Hypothesis | BaseException) -> None:
        resolve_from_thread(self.loop, self.future, result)

    def drop(self) -> None:
        """The pass stopped unfinished, its requests cancelled: nobody awaits it."""
        cancel_from_thread(self.loop, self.future)


class AsrStream:
    """One session's recognizer. Utterances run from `begin` to `finish`.

    Positions are sample indices of the session's 16 kHz stream (as the VAD counts).
    Partial results arrive on `results`; `finish` returns the final one.

    The audio window of a pass starts at the end of the last committed word once the
    window is longer than ``window_s``: committed words move out of the window, and
    their text is given to the decoder as previous-text context instead. Every pass
    then costs about the same however long the caller talks, and so does the final.
    """

    def __init__(self, engine: AsrEngine, partial_interval: int, window_s: float = 4.0) -> None:
        self.engine = engine
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
        self._partial: _Job | None = None
        self._candidate: _Job | None = None  # speculative final started at a pause
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
        would hear only silence, and take a core from the reply being prepared: at one
        session it ran beside the turn's score, the reply's first tokens and its first
        phrase's TTS. One started in the silence before the pause is announced covers
        too little of it to serve as the final (`COVER`), and the final queued behind
        it waited a whole pass."""
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
            partial.taken_as_final = True  # it lets no final run ahead of it now
            self.engine.finals_from_partials += 1
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

    def _submit(self, position: int, final: bool) -> _Job:
        end = min(max(position, self._offset), self._offset + self._audio.size) - self._offset
        job = _Job(self._audio[:end].copy(), self._offset, self._prefix(), final, self._loop)
        job.previous = self._previous_tokens()
        job.previous_keys = self._agreement.previous_keys()
        job.draft = self._agreement.draft()
        job.committed = len(self._agreement.committed)
        job.earlier = tuple(self._earlier)
        job.word_times = final and self.word_times
        self.engine.submit(job)
        return job

    def _prefix(self) -> list[int]:
        return [t for w in self._agreement.committed for t in w.tokens]

    def _previous_tokens(self) -> list[int]:
        return [t for w in self._earlier for t in w.tokens][-PREVIOUS_TEXT_TOKENS:]

    def _start_partial(self) -> None:
        job = self._submit(self._offset + self._audio.size, final=False)
        self._partial = job
        job.future.add_done_callback(lambda f: self._on_partial(job, f))

    def _on_partial(self, job: _Job, future: asyncio.Future[_Hypothesis]) -> None:
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


def _cut(hyp: _Hypothesis, start: int) -> tuple[str, int]:
    """A window of a long transcription, not its last: its text up to the last word
    ending 2 s before the window's end, and where the next window starts (there)."""
    end = start + WINDOW
    keep = [w for w in hyp.words if w.end < end - 2 * SAMPLE_RATE] or hyp.words
    return "".join(w.text for w in keep).strip(), keep[-1].end if keep and keep[-1].end > start else end


def _public(word: HypWord) -> AsrWord:
    return AsrWord(word.text.strip(), word.start, word.end)


def _join(words: list[HypWord]) -> str:
    return "".join(w.text for w in words).strip()
