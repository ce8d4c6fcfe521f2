"""EchoGate: the double-talk test that tells the caller from the reply's echo."""

from __future__ import annotations

import numpy as np

from duplex.echo import FLOOR_DB, EchoGate, band_levels_db, level_db

RATE = 16000
TTS_RATE = 22050


def tone(hz: float, db: float, rate: int = RATE, seconds: float = 0.02) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return np.rint(np.sin(2 * np.pi * hz * t) * 32768 * 10 ** (db / 20) * np.sqrt(2)).astype(np.int16)


def hiss(db: float, seed: int = 0) -> np.ndarray:
    """A fricative: noise above 3 kHz."""
    noise = np.random.default_rng(seed).standard_normal(4096)
    spectrum = np.fft.rfft(noise)
    spectrum[np.fft.rfftfreq(4096, 1 / RATE) < 3500] = 0
    band = np.fft.irfft(spectrum)[:320]
    return np.rint(band / np.sqrt(np.mean(band**2)) * 32768 * 10 ** (db / 20)).astype(np.int16)


def test_band_levels_split_the_spectrum_and_add_up_to_the_level():
    low, high = band_levels_db(tone(500, -20), RATE)
    assert abs(low - -20) < 0.2 and high < -60
    low, high = band_levels_db(tone(5000, -30, TTS_RATE), TTS_RATE)
    assert abs(high - -30) < 0.3 and low < -40  # the same level at the voice's own rate
    mix = tone(500, -20) + tone(5000, -20)
    total = 10 * np.log10(np.sum(10 ** (band_levels_db(mix, RATE) / 10)))
    assert abs(total - level_db(mix)) < 0.3
    frames = np.stack([tone(500, -20), tone(5000, -30), np.zeros(320, np.int16)])
    levels = band_levels_db(frames, RATE)  # many frames at once
    assert levels.shape == (3, 2) and levels[2, 0] == -np.inf


def test_the_echo_of_the_reply_is_echo_and_a_louder_voice_is_the_caller():
    gate = EchoGate(suppression_db=12)
    for k in range(20):  # a reply: vowels at -10 dBFS with a fricative now and then
        gate.record_sent(
            tone(400, -10, TTS_RATE) + tone(5000, -28 if k % 5 == 0 else -50, TTS_RATE), TTS_RATE, k * 0.02
        )
    now = 0.5  # after the first 0.4 s of the reply, when its echo was measured (see below)
    echo = band_levels_db(tone(400, -30) + tone(5000, -48), RATE)  # the reply at -20 dB
    assert gate.is_echo(echo, 0.3, now)
    assert not gate.is_echo(band_levels_db(tone(400, -15), RATE), 0.3, now)  # a voice near the reply's level
    assert gate.is_echo(band_levels_db(tone(400, -25), RATE), 0.3, now)  # broadband, too quiet for the caller


def test_a_fricative_under_the_replys_vowels_is_the_caller():
    gate = EchoGate(suppression_db=12)
    for k in range(20):  # vowels only: loud below 3 kHz, quiet above
        gate.record_sent(tone(400, -10, TTS_RATE) + tone(4000, -45, TTS_RATE), TTS_RATE, k * 0.02)
    s = hiss(-30)  # "S-" of "Stop": 20 dB under the reply's vowels
    assert level_db(s) < -10 - 12  # too quiet broadband to pass a level test
    assert not gate.is_echo(band_levels_db(s, RATE), 0.3, 0.5)


def test_a_loud_line_is_measured_at_the_start_of_the_reply_and_gated_for_it():
    gate = EchoGate(suppression_db=12)
    for k in range(40):
        gate.record_sent(tone(400, -10, TTS_RATE), TTS_RATE, k * 0.02)
    loud_echo = band_levels_db(tone(400, -19), RATE)  # a line that echoes at -9 dB
    for k in range(1, 21):  # its first 0.4 s: inbound audio is taken for echo, and measured
        assert gate.is_echo(loud_echo, k * 0.02 - 0.02, k * 0.02)
        gate.train(loud_echo, k * 0.02)
    assert gate.effective_db == 12  # not decided until the measuring is over
    gate.train(loud_echo, 0.42)
    assert abs(gate.effective_db - 5.0) < 0.1  # 4 dB under the loudest echo measured
    assert gate.is_echo(loud_echo, 0.42, 0.6)  # the echo no longer passes for the caller...
    assert not gate.is_echo(band_levels_db(tone(400, -12), RATE), 0.42, 0.6)  # ...a voice does
    gate.record_sent(tone(400, -10, TTS_RATE), TTS_RATE, 5.0)  # the next reply is measured anew
    gate.train(band_levels_db(tone(400, -40), RATE), 5.1)
    gate.train(band_levels_db(tone(400, -40), RATE), 5.5)
    assert gate.effective_db == 12  # a quiet line keeps the setting
    gate.record_sent(tone(400, -10, TTS_RATE), TTS_RATE, 9.0)
    gate.train(band_levels_db(tone(400, -9), RATE), 9.1)  # the caller talked at once, loudly
    gate.train(loud_echo, 9.5)
    assert gate.effective_db == 4.0  # never under MIN_SUPPRESSION_DB


def test_nothing_sent_nothing_quiet_is_the_caller():
    gate = EchoGate()
    quiet = band_levels_db(tone(400, FLOOR_DB - 3) + hiss(FLOOR_DB - 3), RATE)
    assert gate.is_echo(quiet, 0.0, 1.0)  # under the floor: never the caller
    assert gate.is_echo(band_levels_db(np.zeros(320, np.int16), RATE), 0.0, 1.0)
    assert not gate.is_echo(band_levels_db(tone(400, -30), RATE), 0.0, 1.0)
    gate.record_sent(tone(400, -10, TTS_RATE), TTS_RATE, 1.0)
    assert gate.active(1.3) and not gate.active(1.5)  # echo may arrive up to 0.4 s later
    assert gate.is_echo(band_levels_db(tone(400, -30), RATE), 1.1, 1.2)
    assert not gate.is_echo(band_levels_db(tone(400, -30), RATE), 1.5, 1.6)  # sent too long before
