"""Inbound: the checks on the caller's audio, its arrival times, its level against the echo."""

from __future__ import annotations

import time

import numpy as np

from audio_io.frame import AudioFrame
from duplex.echo import EchoGate
from duplex.echo_canceller import EchoCanceller
from duplex.inbound import LEVEL_WINDOW, Inbound
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


async def test_the_caller_is_found_where_they_rise_over_the_echo() -> None:
    echo = EchoGate(suppression_db=12)
    now = time.monotonic()
    for k in range(40):  # a reply at -10 dBFS, sent in the last 0.8 s
        echo.record_sent(tone(-10, TTS_RATE), TTS_RATE, now - 0.8 + k * 0.02)
    inbound = Inbound(SessionConfig(), echo)
    # its echo at -30 dBFS, then the caller at -12 from the 4th 20 ms window on
    audio = np.concatenate([tone(-30)] * 3 + [tone(-12)] * 2)
    inbound.push(AudioFrame(np.zeros(3200, np.int16), 16000))  # arrived now
    await inbound.next(0)
    assert inbound.first_above_echo(audio[: 3 * LEVEL_WINDOW], 1600) is None
    assert inbound.first_above_echo(audio, 1600) == 1600 + 3 * LEVEL_WINDOW
    assert inbound.first_above_echo(audio[:100], 1600) is None  # under 20 ms: nothing to judge
    later = time.monotonic()
    assert not inbound.may_be_echo(tone(-12), tone(-12), later - 0.5, later)
    assert inbound.may_be_echo(tone(-30), tone(-30), later - 0.5, later)
    assert not inbound.may_be_echo(tone(-12), tone(-30), later - 0.5, later)  # no canceller: the audio
    cancelling = Inbound(SessionConfig(), echo, EchoCanceller())
    assert cancelling.may_be_echo(tone(-12), tone(-30), later - 0.5, later)  # judged on what it leaves
