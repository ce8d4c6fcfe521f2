"""`VirtualCaller`: a scripted caller for tests and benchmarks, in real time.

It is the session's `Sink` and its microphone at once. It plays a timeline into the
session as 20 ms frames on a drift-free real-time grid: speech, silence, waits for the
assistant (until a reply is done, or until some seconds of it were heard, to interrupt
there), and mixes into its microphone the echo of what it hears (attenuated, delayed,
and through a room if ``echo_room``), as a speakerphone without echo cancellation would.
It records every frame and event with its arrival time (what it heard, and when); its
loudspeaker plays each frame as a jitter-buffered client does, ``echo_delay_s`` after the
instant the server meant it to play (``playout_time``; a frame run is contiguous), or
as it arrives if it arrives later than that.

    timeline ─► mic frames (speech | silence) + echo ─► session.push_audio
    session ─► audio / event / flush / end_reply ─► recorded, and echoed into the mic
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from audio_io.frame import AudioFrame
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import Resampler
from duplex import events as ev
from duplex.echo_canceller import RUN_SLACK_S
from duplex.events import Event

FRAME = RUNTIME_RATE // 50  # 20 ms
ROOM_RT60_S = 0.15  # `room_response`: a small, furnished room ...
ROOM_S = 0.1  # ... its response this long


def room_response(
    rt60_s: float = ROOM_RT60_S, seconds: float = ROOM_S, seed: int = 0
) -> npt.NDArray[np.float32]:
    """A room's impulse response at 16 kHz: the direct sound, then reflections as noise
    decaying 60 dB in ``rt60_s``; unit energy (the echo's level is set apart). Fixed by
    ``seed``: every run hears the same room."""
    t = np.arange(round(seconds * RUNTIME_RATE)) / RUNTIME_RATE
    response = np.random.default_rng(seed).standard_normal(t.size) * np.exp(-6.9 * t / rt60_s) * 0.25
    response[0] = 1.0
    return (response / np.sqrt(np.sum(response**2))).astype(np.float32)


class Microphone(Protocol):
    """Where the caller's microphone goes: a session (`SessionPort`) or a test's stand-in."""

    def push_audio(self, frame: AudioFrame) -> None: ...


def frame_power(samples: npt.NDArray[np.int16]) -> npt.NDArray[np.float64]:
    """The mean square of each whole 10 ms frame, in int16 units."""
    hop = RUNTIME_RATE // 100
    n = samples.size // hop
    return np.mean(samples[: n * hop].astype(np.float64).reshape(n, hop) ** 2, axis=1)


def voiced_frames(samples: npt.NDArray[np.int16]) -> npt.NDArray[np.bool_]:
    """Which 10 ms frames are the voice: louder than 40 dB under the loudest, and than
    10 dB over the background (the quietest tenth of the frames), so that a recording's
    room noise is not taken for the voice, though never asked to be within 20 dB of
    the loudest (a clip that is voice throughout has no background)."""
    power = frame_power(samples)
    if power.size == 0:
        return np.zeros(0, np.bool_)
    peak = power.max()
    return power > max(peak * 1e-4, min(np.percentile(power, 10) * 10, peak * 1e-2))


@dataclass(frozen=True)
class Speak:
    samples: npt.NDArray[np.int16]  # 16 kHz mono

    def voiced(self) -> tuple[float, float]:
        """Seconds from the start to the first and past the last voiced 10 ms
        (`voiced_frames`)."""
        loud = np.flatnonzero(voiced_frames(self.samples))
        if loud.size == 0:
            return 0.0, self.samples.size / RUNTIME_RATE
        return float(loud[0]) / 100, float(loud[-1] + 1) / 100


@dataclass(frozen=True)
class Silence:
    seconds: float


@dataclass(frozen=True)
class UntilReplyDone:
    """Silence until the assistant's reply is done (or `timeout`), then `after` more."""

    timeout: float = 30.0
    after: float = 0.0


@dataclass(frozen=True)
class UntilHeard:
    """Silence until `seconds` of the current reply's audio have arrived (to interrupt
    there), or until that reply ended shorter: the caller then goes on, as a person
    would, instead of waiting out the timeout in silence."""

    seconds: float
    timeout: float = 30.0


Step = Speak | Silence | UntilReplyDone | UntilHeard


@dataclass
class Received:
    at: float
    response_id: str
    samples: int  # at the voice's rate


@dataclass
class VirtualCaller:
    echo_db: float | None = None  # e.g. -20: the assistant's voice comes back this much quieter
    echo_delay_s: float = 0.1
    echo_room: bool = False  # the echo comes back through a room (`room_response`), not straight
    frames: list[Received] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    flushes: list[float] = field(default_factory=list)
    ended: list[tuple[str, bool]] = field(default_factory=list)  # (response id, completed), from end_reply
    speech_ends: list[float] = field(default_factory=list)  # when each Speak step's audio ended
    voice_spans: list[tuple[float, float]] = field(default_factory=list)  # (first, last) voiced instants
    sound_spans: list[tuple[float, float]] = field(default_factory=list)  # each Speak step's audio, all of it

    def __post_init__(self) -> None:
        self._start = 0.0
        self._echo = np.zeros(0, np.float32)  # future mic additions, from mic position _echo_base
        self._echo_base = 0
        self._mic_position = 0
        self._heard: dict[str, int] = {}  # samples of each reply received (and so played)
        # the replies' creations and ends, apart: the timeline asks of them every 20 ms, and
        # a scan of all the events (one a frame of audio) took 7% of the event loop at 8 callers
        self._created: list[Event] = []
        self._done: list[Event] = []
        self._rate = 0
        self._ear: Resampler | None = None  # the reply's audio, as the microphone picks it up
        self._room = room_response() if self.echo_room else None
        self._room_spectra: dict[int, npt.NDArray[np.complex128]] = {}
        self._played_end: int | None = None  # mic position where the loudspeaker's run ends ...
        self._run_until = 0.0  # ... and when the server meant it to end

    # -- Sink --

    def audio(self, frame: AudioFrame, response_id: str) -> None:
        now = time.monotonic()
        self._rate = frame.sample_rate
        self.frames.append(Received(now, response_id, frame.num_samples))
        self.events.append(Event(ev.AUDIO_DELTA, {"response_id": response_id}, now))
        self._heard[response_id] = self._heard.get(response_id, 0) + frame.num_samples
        if self.echo_db is not None and self._start:
            if self._ear is None or self._ear.in_rate != frame.sample_rate:
                self._ear = Resampler(frame.sample_rate, RUNTIME_RATE)
            sound = self._ear.process(frame.samples).astype(np.float32)
            due = frame.playout_time if frame.playout_time is not None else now
            # on the server's grid, rounded as the server rounds it (`EchoCanceller.play`), so
            # the echo's delay is the same sample for sample from one frame run to the next
            played = (
                round(due * RUNTIME_RATE)
                - round(self._start * RUNTIME_RATE)
                + round(self.echo_delay_s * RUNTIME_RATE)
            )
            played = max(played, round((now - self._start) * RUNTIME_RATE))  # not before it arrives
            if self._played_end is not None and abs(due - self._run_until) <= RUN_SLACK_S:
                played = self._played_end  # the run goes on, sample after sample
            played = max(played, self._mic_position)  # never into audio the microphone already sent
            self._played_end = played + sound.size
            self._run_until = due + frame.duration
            echo = sound if self._room is None else self._through_room(sound)
            echo *= 10 ** (self.echo_db / 20)
            at = played - self._echo_base
            end = at + echo.size
            if end > self._echo.size:
                self._echo = np.concatenate([self._echo, np.zeros(end - self._echo.size, np.float32)])
            self._echo[at:end] += echo

    def _through_room(self, sound: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``sound`` convolved with the room's response (by FFT: 8 callers' echo must not
        take the CPU the service is measured on)."""
        assert self._room is not None
        size = sound.size + self._room.size - 1
        n = 1 << (size - 1).bit_length()
        if n not in self._room_spectra:  # the room's spectrum, once per FFT size
            self._room_spectra[n] = np.fft.rfft(self._room, n)
        spectrum = np.fft.rfft(sound, n) * self._room_spectra[n]
        return np.fft.irfft(spectrum, n)[:size].astype(np.float32)

    def event(self, event: Event) -> None:
        self.events.append(event)
        if event.type == ev.RESPONSE_CREATED:
            self._created.append(event)
        elif event.type == ev.RESPONSE_DONE:
            self._done.append(event)

    def flush(self) -> None:
        self.flushes.append(time.monotonic())

    def end_reply(self, response_id: str, completed: bool) -> None:
        """It plays each frame as it arrives, whole (nothing partial to pad or drop)."""
        self.ended.append((response_id, completed))

    # -- the microphone --

    def heard_s(self, response_id: str) -> float:
        return self.played(response_id) / self._rate if self._rate else 0.0

    def _replied(self) -> bool:
        """The reply to the caller's last words ended after they stopped speaking: one
        created since their voice began (`_current_response`), or one that played out (a
        reply they talked over and that then resumed). A reply their words cut ends
        after they stop too, but is not it."""
        began, stopped = self._last_words()
        answers = {e.data["response_id"] for e in self._created if e.at > began}
        return any(
            e.at > stopped and (e.data["response_id"] in answers or e.data.get("status") == "completed")
            for e in self._done
        )

    def _ended(self, response_id: str) -> bool:
        """Whether that reply's audio has ended (played out or cut)."""
        return any(ended == response_id for ended, _ in self.ended)

    def _current_response(self) -> str | None:
        """The reply to the caller's last words: the last created since their voice
        began. Not since the step ended: a turn judged over in a pause has its reply
        created (`Event.at`: when it was begun, held back) while the clip's quiet tail
        still plays, and the step then waited its whole timeout for a reply."""
        began, _ = self._last_words()
        created = [e for e in self._created if e.at > began]
        return str(created[-1].data["response_id"]) if created else None

    def _last_words(self) -> tuple[float, float]:
        """When the caller's last words began to be voiced, and when their step ended."""
        if not self.speech_ends:
            return 0.0, 0.0
        return self.voice_spans[-1][0], self.speech_ends[-1]

    async def play(self, session: Microphone, timeline: list[Step], rate: int = RUNTIME_RATE) -> None:
        """Play the timeline into the session in real time (`rate`: the mic's rate)."""
        self._start = time.monotonic()
        self._echo, self._echo_base, self._mic_position = np.zeros(0, np.float32), 0, 0
        self._played_end = None
        mouth = Resampler(RUNTIME_RATE, rate)  # the microphone's rate, if not the runtime's
        k = 0  # frames played
        for step in timeline:
            if isinstance(step, Speak):
                begin = self._start + k * 0.02
                first, last = step.voiced()
                self.voice_spans.append((begin + first, begin + last))
                self.sound_spans.append((begin, begin + step.samples.size / RUNTIME_RATE))
            done = 0
            deadline = time.monotonic() + (getattr(step, "timeout", 0.0) or 0.0)
            after: float | None = None
            while True:
                if isinstance(step, Speak):
                    if done >= step.samples.size:
                        self.speech_ends.append(self._start + k * 0.02)
                        break
                    chunk = step.samples[done : done + FRAME]
                elif isinstance(step, Silence):
                    if done >= round(step.seconds * RUNTIME_RATE):
                        break
                    chunk = np.zeros(0, np.int16)
                elif isinstance(step, UntilReplyDone):
                    if after is None and (self._replied() or time.monotonic() > deadline):
                        after = time.monotonic() + step.after
                    if after is not None and time.monotonic() >= after:
                        break
                    chunk = np.zeros(0, np.int16)
                else:
                    current = self._current_response()
                    if current and (self.heard_s(current) >= step.seconds or self._ended(current)):
                        break
                    if time.monotonic() > deadline:
                        break
                    chunk = np.zeros(0, np.int16)
                frame = np.zeros(FRAME, np.float32)
                frame[: chunk.size] = chunk
                frame += self._take_echo()
                mic = mouth.process(np.clip(np.rint(frame), -32768, 32767).astype(np.int16))
                done += FRAME
                k += 1
                delay = self._start + k * 0.02 - time.monotonic()
                if delay > 0:  # a microphone delivers a frame once it has captured all of it
                    await asyncio.sleep(delay)
                session.push_audio(AudioFrame(mic, rate, capture_time=time.monotonic()))

    def _take_echo(self) -> npt.NDArray[np.float32]:
        start = self._mic_position - self._echo_base
        out = np.zeros(FRAME, np.float32)
        part = self._echo[start : start + FRAME]
        out[: part.size] = part
        self._mic_position += FRAME
        if start + FRAME > 4 * RUNTIME_RATE:  # drop what was played
            self._echo = self._echo[start + FRAME :]
            self._echo_base = self._mic_position
        return out

    # -- reading the record --

    def first_frame(self, response_id: str) -> float | None:
        return next((f.at for f in self.frames if f.response_id == response_id), None)

    def last_frame(self, response_id: str) -> float | None:
        return max((f.at for f in self.frames if f.response_id == response_id), default=None)

    def played(self, response_id: str) -> int:
        """Samples of this reply the caller played (it plays each frame as it arrives)."""
        return self._heard.get(response_id, 0)

    def of_type(self, type_: str) -> list[Event]:
        return [e for e in self.events if e.type == type_]

    def sequence(
        self, ignore: frozenset[str] = frozenset({ev.STATE, ev.METRICS, ev.TEXT_DELTA})
    ) -> list[str]:
        """Event types in order, deltas of a kind collapsed into one."""
        out: list[str] = []
        for e in self.events:
            if e.type in ignore or (out and out[-1] == e.type and e.type.endswith(".delta")):
                continue
            out.append(e.type)
        return out


def heard_by_marks(text: str, marks: list[tuple[int, int, int, int]], played: int) -> str:
    """The caller's own account of what it heard of a reply: the text up to the last word
    (``(char_start, char_end, sample_start, sample_end)``) of which at least half was
    played. Independent of the server's ledger, to check it."""
    heard = [m for m in marks if m[2] + -(-(m[3] - m[2]) // 2) <= played]
    return text[: heard[-1][1]] if heard else ""
