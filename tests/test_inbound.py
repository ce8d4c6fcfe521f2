"""Inbound: the checks on the caller's audio, its arrival times, its level against the echo."""

from __future__ import annotations

import time

import numpy as np

from audio_io.frame import AudioFrame
from duplex.echo import EchoGate
from duplex.echo_canceller import EchoCanceller
from duplex.inbound import Inbound
from duplex.session_config import SessionConfig

TTS_RATE = 22050


def tone(db: float, rate: int = 16000, seconds: float = 0.02) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return np.rint(np.sin(2 * np.pi * 400 * t) * 32768 * 10 ** (db / 20) * np.sqrt(2)).astype(np.int16)


def test_bad_audio_is_told_once_until_a_good_frame() -> None:
    inbound = Inbound(SessionConfig(input_rate=8000, max_inbound_s=0.05), EchoGate())
    wrong = AudioFrame(np.zeros(320, np.int16), 16000)
    error = inbound.push(wrong)
    assert error is not None and error.code == "bad_audio_format" and "8000" in str(error)
    assert inbound.push(wrong) is None  # told already
    good = AudioFrame(np.zeros(160, np.int16), 8000)
    assert inbound.push(good) is None and inbound.push(good) is None
    overflow = inbound.push(good)  # 60 ms queued: more than 50
    assert overflow is not None and overflow.code == "input_overflow"
    assert inbound.push(good) is None
    error = inbound.push(wrong)
    assert error is not None and error.code == "bad_audio_format"  # a new condition is told


async def test_frames_come_out_at_16_khz_with_their_arrival_times() -> None:
    inbound = Inbound(SessionConfig(input_rate=8000, input_channels=2), EchoGate())
    before = time.monotonic()
    for _ in range(3):
        assert inbound.push(AudioFrame(np.zeros(320, np.int16), 8000, channels=2)) is None
    position = 0
    arrivals = []
    for _ in range(3):
        samples, residual, arrived = await inbound.next(position)
        assert residual is samples  # no echo canceller: the residual is the audio
        position += samples.size
        arrivals.append(arrived)
    assert before <= arrivals[0] <= arrivals[1] <= arrivals[2] <= time.monotonic()
    assert 0 < position <= 960  # 60 ms at 16 kHz, less the resampler's start-up delay
    assert inbound.arrival(0) == arrivals[0]
    assert inbound.arrival(position - 1) == arrivals[2]
    assert inbound.arrival(position + 100) >= arrivals[2]  # not arrived yet: now


def test_levels_and_the_room() -> None:
    inbound = Inbound(SessionConfig(), EchoGate())
    level, room = inbound.level(tone(-40))
    assert abs(level - -40) < 0.2 and room == level
    level, room = inbound.level(tone(-10))
    assert abs(level - -10) < 0.2 and abs(room - -40) < 0.2  # the quietest of the last 2 s
    for _ in range(99):
        inbound.level(tone(-10))
    assert abs(inbound.level(tone(-10))[1] - -10) < 0.2  # the quiet frame is over 2 s old


async def hear(inbound: Inbound, frames: list[np.ndarray], position: int) -> int:
    """Frames (16 kHz) pushed and taken in, from stream ``position``; where they end."""
    for frame in frames:
        inbound.push(AudioFrame(frame, 16000))
        samples, _, _ = await inbound.next(position)
        position += samples.size
    return position


def reply_sent(echo: EchoGate) -> None:
    now = time.monotonic()
    for k in range(40):  # a reply at -10 dBFS, sent in the last 0.8 s
        echo.record_sent(tone(-10, TTS_RATE), TTS_RATE, now - 0.8 + k * 0.02)


async def test_the_caller_is_found_where_they_rise_over_the_echo() -> None:
    echo = EchoGate(suppression_db=12)
    reply_sent(echo)
    inbound = Inbound(SessionConfig(), echo)
    # the reply's echo at -30 dBFS, then the caller at -12 from 2,560 on
    end = await hear(inbound, [tone(-30)] * 8, 0)
    assert end == 2560  # every frame heard
    assert inbound.first_above_echo(1600) is None
    assert await hear(inbound, [tone(-12)] * 2, end) == 3200
    assert inbound.first_above_echo(1600) == 2560
    assert inbound.first_above_echo(2600) == 2600  # the window it begins in counts from there
    assert inbound.first_above_echo(3200) is None  # nothing heard from there on
    assert not inbound.may_be_echo(time.monotonic() - 0.5, time.monotonic())  # the last window
    assert await hear(inbound, [tone(-30)], 3200) == 3520
    assert inbound.may_be_echo(time.monotonic() - 0.5, time.monotonic())
    # 10 ms frames: judged in whole 20 ms windows all the same
    halves = Inbound(SessionConfig(), echo)
    frames = [tone(-30)] * 8 + [tone(-12)] * 2
    assert await hear(halves, [half for frame in frames for half in np.split(frame, 2)], 0) == 3200
    assert halves.first_above_echo(1600) == 2560


class Quieting(EchoCanceller):
    """A canceller that leaves the frame 12 dB quieter, wherever it is."""

    def cancel(self, samples: np.ndarray, position: int, arrived: float) -> np.ndarray:
        return np.rint(samples * 10 ** (-12 / 20)).astype(np.int16)


async def test_over_a_canceller_the_gate_judges_what_it_leaves() -> None:
    echo = EchoGate(suppression_db=12)
    reply_sent(echo)
    inbound = Inbound(SessionConfig(), echo, Quieting())
    end = await hear(inbound, [tone(-30)] * 8 + [tone(-12)] * 2, 0)
    assert end == 3200  # every frame heard
    # the caller's -12 dBFS left at -24: under what the echo could be (-22), as the echo is
    assert inbound.first_above_echo(1600) is None
    assert inbound.may_be_echo(time.monotonic() - 0.5, time.monotonic())
    await hear(inbound, [tone(-6)], end)  # left at -18: over it
    assert inbound.first_above_echo(1600) == end
