"""EchoCanceller: the reply's echo taken out of the caller's audio. The reply is the
bundled voice, sent at 24 kHz as a transport would; its echo comes back at -20 dB
through a room (`room_response`), as `VirtualCaller` makes it."""

from __future__ import annotations

import numpy as np
import pytest

from audio_io.frame import AudioFrame
from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import Resampler, resample
from benchmarks.caller import room_response, voiced_frames
from duplex.echo import EchoGate
from duplex.echo_canceller import BLOCK, EchoCanceller, gcc_phat_lag
from duplex.inbound import Inbound
from duplex.session_config import SessionConfig

SENT_RATE = 24000
SENT_FRAME = SENT_RATE // 50
T0 = 1000.0  # the monotonic clock at the first frame
REPLY = (
    "Sure. The museum opens at nine in the morning and closes at six in the evening, every day "
    "except Monday, when it is closed for cleaning and repairs."
)


@pytest.fixture(scope="module")
def reply(tts_engine) -> np.ndarray:
    """The reply as sent: 24 kHz int16, whole 20 ms frames."""
    audio = resample(tts_engine.synthesize(REPLY).audio, tts_engine.sample_rate, SENT_RATE)
    return audio[: audio.size // SENT_FRAME * SENT_FRAME]


@pytest.fixture(scope="module")
def caller_line(tts_engine) -> np.ndarray:
    """A caller's words at 16 kHz, from a quiet start."""
    audio = tts_engine.synthesize("Actually, what is two plus two?").audio
    return resample(audio, tts_engine.sample_rate, RUNTIME_RATE)


def db(x: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.square(x.astype(np.float64))) + 1e-9))


def echo_of(reply: np.ndarray, delay_s: float, level_db: float = -20.0) -> np.ndarray:
    """What the microphone picks up, 16 kHz float: the reply as the loudspeaker played it
    (resampled frame by frame, as the client hears it), through the room."""
    ear = Resampler(SENT_RATE, RUNTIME_RATE)
    played = np.concatenate([ear.process(f) for f in reply.reshape(-1, SENT_FRAME)]).astype(np.float64)
    through = np.convolve(played, room_response()) * 10 ** (level_db / 20)
    delay = round(delay_s * RUNTIME_RATE)
    return np.concatenate([np.zeros(delay), through])


def mix(*parts: tuple[np.ndarray, int], seconds: float) -> np.ndarray:
    out = np.zeros(round(seconds * RUNTIME_RATE))
    for audio, at in parts:
        end = min(out.size, at + audio.size)
        out[at:end] += audio[: end - at]
    return np.clip(np.rint(out), -32768, 32767).astype(np.int16)


def run(
    canceller: EchoCanceller, reply: np.ndarray, mic: np.ndarray, caller_from: int | None = None
) -> np.ndarray:
    """Play the reply and hear the microphone, 20 ms at a time on one clock; the canceller
    learns from every frame before ``caller_from`` (the gate's verdict, known here)."""
    frames = reply.reshape(-1, SENT_FRAME)
    out = []
    for k in range(mic.size // BLOCK):
        if k < len(frames):
            canceller.play(frames[k], SENT_RATE, T0 + 0.02 * k)
        out.append(canceller.cancel(mic[k * BLOCK : (k + 1) * BLOCK], k * BLOCK, T0 + 0.02 * (k + 1)))
        canceller.adapt(echo_only=caller_from is None or (k + 1) * BLOCK <= caller_from)
    assert out, "nothing was heard"
    return np.concatenate(out)


def test_the_delay_is_found_and_the_echo_taken_out(reply):
    echo = echo_of(reply, 0.15)
    seconds = reply.size / SENT_RATE
    mic = mix((echo, 0), seconds=seconds)
    canceller = EchoCanceller()
    residual = run(canceller, reply, mic)
    assert canceller.lag is not None and abs(canceller.lag - 2400) <= 4  # 150 ms, and the resampler's own
    last = slice(mic.size - 2 * RUNTIME_RATE, mic.size)  # the last 2 s, long after the lock
    assert db(mic[last]) - db(residual[last]) > 20  # measured: ~30 dB (docs/performance.md)


def test_the_callers_voice_comes_through_and_the_echo_stays_out(reply, caller_line):
    echo = echo_of(reply, 0.1)
    seconds = reply.size / SENT_RATE
    onset = round((seconds - 2.5) * RUNTIME_RATE)
    mic = mix((echo, 0), (caller_line, onset), seconds=seconds)
    residual = run(EchoCanceller(), reply, mic, caller_from=onset)
    over = slice(onset, onset + caller_line.size)
    caller = mix((caller_line, onset), seconds=seconds)[over].astype(np.float64)
    left = residual[over].astype(np.float64) - caller  # what is left of the echo under the caller
    assert db(echo[over]) - db(left) > 20
    assert db(caller) - db(left) > 40  # the caller's words as they were said


def test_nothing_played_nothing_taken():
    canceller = EchoCanceller()
    noise = np.random.default_rng(0).normal(0, 1000, 3 * RUNTIME_RATE).astype(np.int16)
    frames = 0
    for k in range(noise.size // BLOCK):
        part = noise[k * BLOCK : (k + 1) * BLOCK]
        assert np.array_equal(canceller.cancel(part, k * BLOCK, T0 + 0.02 * (k + 1)), part)
        canceller.adapt(echo_only=True)
        frames += 1
    assert frames == 150 and canceller.lag is None


def test_gcc_phat_finds_a_lag_and_says_how_sharply():
    rng = np.random.default_rng(1)
    played = rng.standard_normal(16000 + 4000).astype(np.float32)
    heard = 0.1 * played[4000 - 1234 : 4000 - 1234 + 16000]  # played 1234 samples earlier
    lag, peak = gcc_phat_lag(heard, played, 4000)
    assert lag == 1234 and peak > 100
    _, unrelated = gcc_phat_lag(rng.standard_normal(16000).astype(np.float32), played, 4000)
    assert unrelated < 8  # noise against noise: no lock (LOCK_PEAK)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("cancel", [True, False])
async def test_a_soft_onset_under_the_echo(reply, caller_line, monkeypatch, cancel):
    """A caller softer than the reply's echo: with the canceller, the gate finds their
    voice where it begins (measured: as soft as 14 dB under the echo); without it, the
    echo's level hides them. Judged by stream position, not by time."""
    clock = Clock()
    monkeypatch.setattr("duplex.inbound.time.monotonic", clock)
    seconds = reply.size / SENT_RATE
    onset = round((seconds - 2.5) * RUNTIME_RATE)
    voiced = np.flatnonzero(voiced_frames(caller_line))
    begins = onset + int(voiced[0]) * RUNTIME_RATE // 100  # the first voiced 10 ms
    soft = caller_line * 10 ** (-22 / 20)  # the same voice as the reply, 2 dB under its echo
    mic = mix((echo_of(reply, 0.1), 0), (soft, onset), seconds=seconds)
    gate = EchoGate(suppression_db=12)
    canceller = EchoCanceller() if cancel else None
    inbound = Inbound(SessionConfig(), gate, canceller)
    frames = reply.reshape(-1, SENT_FRAME)
    found, judged = None, 0
    for k in range(mic.size // BLOCK):
        due = T0 + 0.02 * k
        if k < len(frames):
            gate.record_sent(frames[k], SENT_RATE, due)
            if canceller is not None:
                canceller.play(frames[k], SENT_RATE, due)
        clock.now = due + 0.02
        inbound.push(AudioFrame(mic[k * BLOCK : (k + 1) * BLOCK], RUNTIME_RATE))
        await inbound.next(k * BLOCK)
        if (k + 1) * BLOCK > onset and found is None:
            found = inbound.first_above_echo(onset)
            judged += 1
    assert judged > 0  # the frames from the onset on were judged
    if cancel:
        assert found is not None and found - begins <= 3 * BLOCK  # within 60 ms of the voice's start
    else:
        assert found is None or found - begins > 3 * BLOCK  # the echo's level hides them


def echo_moved(reply: np.ndarray, delay_s: float, at_s: float, late_s: float) -> np.ndarray:
    """`echo_of`, but from ``at_s`` of the reply on the loudspeaker plays it ``late_s``
    later (a client that played a late frame, and the rest of its run after it)."""
    before, after = reply[: round(at_s * SENT_RATE)], reply[round(at_s * SENT_RATE) :]
    moved = echo_of(after, delay_s + at_s + late_s)
    first = echo_of(before, delay_s)
    out = np.zeros(max(moved.size, first.size))
    out[: first.size] += first
    out[: moved.size] += moved
    return out


@pytest.mark.parametrize("delay_s", [0.04, 0.25])
async def test_an_echo_path_that_moves_is_never_taken_for_the_caller(reply, monkeypatch, delay_s):
    """The loudspeaker plays the reply 10 ms later from 3 s on: until the canceller has
    followed, its estimate adds echo rather than taking it away, and the gate must not
    count what it has taken away from the echo before (measured: without that check,
    1-3 windows a reply were taken for the caller, each enough to cut the reply)."""
    clock = Clock()
    monkeypatch.setattr("duplex.inbound.time.monotonic", clock)
    seconds = reply.size / SENT_RATE
    mic = mix((echo_moved(reply, delay_s, 3.0, 0.01), 0), seconds=seconds)
    gate = EchoGate(suppression_db=12)
    canceller = EchoCanceller()
    inbound = Inbound(SessionConfig(), gate, canceller)
    frames = reply.reshape(-1, SENT_FRAME)
    callers, allowed = [], 0.0
    for k in range(mic.size // BLOCK):
        due = T0 + 0.02 * k
        gate.record_sent(frames[k], SENT_RATE, due)
        canceller.play(frames[k], SENT_RATE, due)
        clock.now = due + 0.02
        inbound.push(AudioFrame(mic[k * BLOCK : (k + 1) * BLOCK], RUNTIME_RATE))
        await inbound.next(k * BLOCK)
        allowed = max(allowed, float(gate.cancelled_db[0]))
        if inbound.first_above_echo(k * BLOCK) is not None:
            callers.append(k * BLOCK / RUNTIME_RATE)
    assert allowed > 10  # the canceller had locked and took the echo away before it moved
    assert canceller.resets >= 2  # ... and locked again on the moved path
    assert callers == []
