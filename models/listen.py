"""`Listener`: the hearing half of a session, VAD and streaming ASR wired together.

It keeps the last two seconds of audio, so that an utterance handed to ASR starts
``preroll_ms`` before the VAD's speech start (nothing of the first word is lost to the
VAD's decision delay) and ends 160 ms after the VAD's end position (which is placed
at the end of the voice, where a fading last sound may still carry a consonant), and
it turns the engines' outputs into one ordered list of events per pushed chunk.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from audio_io.pcm import RUNTIME_RATE
from models.asr import AsrEngine
from models.asr_types import AsrResult
from models.vad import VadConfig, VadEngine, VadEventKind

HISTORY = 2 * RUNTIME_RATE
ASR_TAIL = 160 * RUNTIME_RATE // 1000  # audio past the VAD's end position that the final pass still gets


class ListenEventKind(enum.Enum):
    SPEECH_STARTED = "speech_started"
    PARTIAL = "partial"
    PAUSED = "paused"  # the voice paused: the turn may be over (ASR's speculative final runs)
    SPEECH_STOPPED = "speech_stopped"
    FINAL = "final"


@dataclass(frozen=True)
class ListenEvent:
    kind: ListenEventKind
    position: int  # 16 kHz stream position
    result: AsrResult | None = None
    at: float = field(default_factory=time.monotonic)  # when the event happened
    silence_ms: float | None = None  # SPEECH_STOPPED: the silence that ended the utterance


class Listener:
    def __init__(
        self,
        vad: VadEngine,
        asr: AsrEngine,
        vad_config: VadConfig | None = None,
        preroll_ms: int = 300,
        partial_interval_ms: int = 500,
    ) -> None:
        self.vad = vad.stream(vad_config)
        self.asr = asr.stream(partial_interval_ms)
        self.preroll = preroll_ms * RUNTIME_RATE // 1000
        self._history = np.zeros(0, np.int16)
        self._end = 0  # stream position after the last pushed sample
        self.speaking = False
        self.ignoring = False  # the utterance in progress is not transcribed (`ignore`)

    def _slice(self, start: int, end: int) -> npt.NDArray[np.int16]:
        first = self._end - self._history.size
        return self._history[max(start, first) - first : max(end, first) - first]

    @property
    def position(self) -> int:
        """The 16 kHz stream position after the last pushed sample."""
        return self._end

    @property
    def voiced_until(self) -> int:
        """Where the current utterance's voice stops so far: the start of the pause the
        VAD is in, or the end of the audio."""
        pause = self.vad.pause
        return pause if self.speaking and pause is not None else self._end

    @property
    def pause(self) -> int | None:
        """Where the pause the VAD is in began (None outside one)."""
        return self.vad.pause

    @property
    def vad_config(self) -> VadConfig:
        return self.vad.config

    @vad_config.setter
    def vad_config(self, config: VadConfig) -> None:
        self.vad.config = config

    @property
    def min_silence_ms(self) -> int:
        """The silence that ends an utterance, unless a pause is held longer (`hold_pause`)."""
        return self.vad.config.min_silence_ms

    @property
    def word_times(self) -> bool:
        """Final results carry their words' times."""
        return self.asr.word_times

    @word_times.setter
    def word_times(self, on: bool) -> None:
        self.asr.word_times = on

    def hold_pause(self, pause: int, silence_ms: int) -> None:
        """The pause that began at ``pause`` ends the utterance only after ``silence_ms``."""
        self.vad.hold_pause(pause, silence_ms)

    async def speculative(self) -> str | None:
        """The words of the utterance up to the pause the VAD is in, once its pass (the
        final's, if the utterance ends in this pause) has run; None if there is none, or
        it was dropped because the caller went on."""
        return await self.asr.speculative()

    @property
    def paused(self) -> bool:
        """In an utterance, in a pause the VAD has announced (speech may still resume)."""
        return self.speaking and self.vad.pause is not None and self.vad.pause_announced

    def restart(self, position: int) -> None:
        """The utterance in progress begins again at ``position``: what the VAD heard
        before it was not the caller (the assistant's echo), and must not be transcribed."""
        assert self.speaking, "restart outside an utterance"
        self._drop_partials()
        start = max(position, self._end - self._history.size)
        self.asr.begin(start)
        self.asr.push(self._slice(start, self._end))
        self.ignoring = False

    def ignore(self) -> None:
        """The utterance in progress is not the caller's so far (the assistant's echo): no
        pass transcribes it, partial or final (its final comes at once, empty), unless
        `restart` says where the caller's voice begins in it."""
        if self.speaking:
            self.asr.cancel()
            self._drop_partials()
            self.ignoring = True

    def _drop_partials(self) -> None:
        """The partial results not read yet: of audio that is not the caller's."""
        while not self.asr.results.empty():
            self.asr.results.get_nowait()

    async def push(self, samples: npt.NDArray[np.int16]) -> list[ListenEvent]:
        """Feed 16 kHz int16 audio; returns what happened, in order."""
        if samples.dtype != np.int16 or samples.ndim != 1:
            raise TypeError(
                f"Listener takes 1-D int16 samples at 16 kHz, got {samples.dtype} {samples.shape}"
            )
        self._history = np.concatenate([self._history, samples])[-HISTORY:]
        self._end += samples.size
        if self.speaking:  # no partial pass starts once the silence has begun (see `AsrStream.push`)
            self.asr.push(samples, partial=self.vad.pause is None)
        events: list[ListenEvent] = []
        for event in await self.vad.push(samples):
            if event.kind is VadEventKind.SPEECH_START:
                self.speaking = True
                self.ignoring = False
                preroll = self._slice(event.position - self.preroll, event.position)
                self.asr.begin(event.position, preroll)
                self.asr.push(self._slice(event.position, self._end))
                events.append(ListenEvent(ListenEventKind.SPEECH_STARTED, event.position))
            elif event.kind is VadEventKind.PAUSE:
                self.asr.pause(event.position + ASR_TAIL, event.position)
                events.append(ListenEvent(ListenEventKind.PAUSED, event.position))
            elif event.kind is VadEventKind.SPEECH_END:
                events += await self._stopped(event.position, event.silence_ms)
        events.extend(self._partials())
        return events

    @property
    def silence_ms(self) -> float:
        """How long the pause the VAD is in has lasted (0 outside one)."""
        pause = self.vad.pause
        return (self._end - pause) * 1000 / RUNTIME_RATE if self.speaking and pause is not None else 0.0

    async def end_turn(self) -> list[ListenEvent]:
        """The caller's turn was judged over in the pause the VAD is in: the utterance
        ends there, as it would after the VAD's whole silence (no events if not paused)."""
        silence_ms = self.silence_ms
        position = self.vad.end_now() if self.paused else None
        return [] if position is None else await self._stopped(position, silence_ms)

    async def _stopped(self, position: int, silence_ms: float | None) -> list[ListenEvent]:
        self.speaking = False
        stopped = ListenEvent(ListenEventKind.SPEECH_STOPPED, position, silence_ms=silence_ms)
        events = [*self._partials(), stopped]
        final = await self.asr.finish(position + ASR_TAIL)
        return [*events, ListenEvent(ListenEventKind.FINAL, position, final)]

    async def flush(self) -> list[ListenEvent]:
        """End of input: finish an utterance still in progress."""
        if not self.speaking:
            return []
        self.speaking = False
        final = await self.asr.finish(self._end)
        return [
            *self._partials(),
            ListenEvent(ListenEventKind.SPEECH_STOPPED, self._end),
            ListenEvent(ListenEventKind.FINAL, self._end, final),
        ]

    def _partials(self) -> list[ListenEvent]:
        out = []
        while not self.asr.results.empty():
            result = self.asr.results.get_nowait()
            out.append(ListenEvent(ListenEventKind.PARTIAL, result.audio_end, result))
        return out

    def close(self) -> None:
        self.asr.cancel()
