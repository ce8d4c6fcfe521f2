import subprocess
import wave
from itertools import pairwise

import numpy as np
import pytest
import soxr

from audio_io.frame import AudioFrame
from audio_io.resample import Reframer, Resampler, downmix, resample


def tone(rate: int, seconds: float, freq: float = 1000.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return np.rint(amplitude * 32767 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def tone_snr_db(signal: np.ndarray, rate: int, freq: float = 1000.0) -> float:
    """SNR of a tone, measured as a sine-fit test does (SINAD, IEEE 1241).

    The best-fitting sinusoid at ``freq`` (any phase, so a constant delay is not
    counted as noise) is the signal; everything else (noise, distortion, aliases,
    clicks) is the noise. 50 ms at each end, where the filters start, are ignored.
    """
    edge = signal.size // 20
    y = signal[edge:-edge].astype(np.float64)
    t = np.arange(edge, signal.size - edge) / rate
    basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t), np.ones_like(t)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, y, rcond=None)
    fit = basis @ coef
    return float(10 * np.log10(np.sum(fit**2) / np.sum((y - fit) ** 2)))


def stream(samples: np.ndarray, in_rate: int, out_rate: int, chunk_ms: int = 20) -> np.ndarray:
    r = Resampler(in_rate, out_rate)
    step = in_rate * chunk_ms // 1000
    parts = [r.process(samples[i : i + step]) for i in range(0, samples.size, step)]
    parts.append(r.flush())
    return np.concatenate(parts)


@pytest.mark.parametrize(("outer", "inner"), [(48000, 16000), (8000, 16000)])
def test_round_trip_keeps_a_1khz_tone(outer, inner):
    x = tone(outer, 1.0)
    y = stream(stream(x, outer, inner), inner, outer)
    assert y.size == x.size
    assert tone_snr_db(x, outer) > 80  # the measure itself: int16 rounding only
    assert tone_snr_db(y, outer) >= 40.0


@pytest.mark.parametrize(
    ("in_rate", "out_rate"), [(48000, 16000), (16000, 48000), (8000, 16000), (16000, 8000)]
)
def test_residual_delay_is_at_most_two_output_samples(in_rate, out_rate):
    # Against soxr's constant-rate one-shot pass, which is exactly delay-compensated.
    rng = np.random.default_rng(1)
    x = rng.integers(-8000, 8000, in_rate).astype(np.int16)
    ours = stream(x, in_rate, out_rate).astype(np.float64)
    exact = soxr.resample(x.astype(np.float32), in_rate, out_rate).astype(np.float64)
    lags = list(range(-8, 9))
    scores = [np.dot(np.roll(ours, -lag)[100:-100], exact[100:-100]) for lag in lags]
    assert abs(lags[int(np.argmax(scores))]) <= 2


@pytest.mark.parametrize(
    ("in_rate", "out_rate"),
    [(48000, 16000), (16000, 48000), (8000, 16000), (16000, 8000), (22050, 16000), (24000, 16000)],
)
def test_streaming_equals_one_shot_within_one_lsb(in_rate, out_rate):
    rng = np.random.default_rng(0)
    x = (tone(in_rate, 1.0) // 2 + rng.integers(-3000, 3000, in_rate)).astype(np.int16)
    one_shot = resample(x, in_rate, out_rate)
    streamed = stream(x, in_rate, out_rate)
    assert one_shot.size == streamed.size == out_rate
    assert np.max(np.abs(one_shot.astype(np.int32) - streamed.astype(np.int32))) <= 1


def test_stream_output_is_steady_not_bursty():
    # 20 ms in gives 20 ms out once the filter has primed: what pacing needs.
    r = Resampler(8000, 16000)
    x = tone(8000, 1.0)
    sizes = [r.process(x[i : i + 160]).size for i in range(0, x.size, 160)]
    assert all(s == 320 for s in sizes[3:])


def test_same_rate_is_passthrough():
    x = tone(16000, 0.1)
    assert Resampler(16000, 16000).process(x) is x


def test_downmix_averages_channels():
    stereo = np.array([100, 300, -5, -6, 32767, 32767], dtype=np.int16)
    assert downmix(stereo, 2).tolist() == [200, -6, 32767]  # -5.5 rounds to even
    with pytest.raises(ValueError, match="channels"):
        downmix(stereo[:5], 2)


def test_reframer_cuts_20ms_frames_with_exact_timestamps():
    reframer = Reframer(16000, 20)
    frames = reframer.push(np.arange(500, dtype=np.int16), capture_time=10.0)
    frames += reframer.push(np.arange(500, 700, dtype=np.int16))
    assert [f.num_samples for f in frames] == [320, 320]
    assert np.array_equal(np.concatenate([f.samples for f in frames]), np.arange(640, dtype=np.int16))
    assert frames[0].capture_time == 10.0
    assert frames[1].capture_time == pytest.approx(10.02)
    assert reframer.pending_samples == 60


def test_audio_frame_validates_its_samples():
    with pytest.raises(TypeError):
        AudioFrame(np.zeros(10, dtype=np.float32), 16000)
    with pytest.raises(ValueError, match="channels"):
        AudioFrame(np.zeros(3, dtype=np.int16), 16000, channels=2)
    with pytest.raises(ValueError, match="whole"):
        AudioFrame.from_pcm16(b"\x00\x01\x02", 16000)
    frame = AudioFrame.from_pcm16(np.arange(4, dtype="<i2").tobytes(), 8000)
    assert frame.duration == 0.0005 and frame.to_pcm16() == np.arange(4, dtype="<i2").tobytes()


def test_speech_resampled_like_sox_does(tmp_path):
    """Real speech (espeak-ng, 22.05 kHz) to 16 kHz: ours against sox's own resampler."""
    wav = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "Barge in whenever you like."], check=True)
    ref = tmp_path / "ref.raw"
    subprocess.run(
        ["sox", str(wav), "-t", "raw", "-e", "signed", "-b", "16", "-r", "16000", str(ref)], check=True
    )
    with wave.open(str(wav)) as w:
        assert w.getframerate() == 22050 and w.getnchannels() == 1
        speech = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16)
    ours = stream(speech, 22050, 16000).astype(np.float64)
    theirs = np.fromfile(ref, dtype="<i2").astype(np.float64)
    assert abs(ours.size - theirs.size) <= 2
    # The filters differ in transition band and residual delay, so compare what a
    # listener hears: the long-term spectrum, in 1/3-octave-ish bands up to 7 kHz.
    edges = np.geomspace(100, 7000, 19)
    band_db = []
    for signal in (ours, theirs):
        spectrum = np.abs(np.fft.rfft(signal[:16000], n=32768)) ** 2
        freqs = np.fft.rfftfreq(32768, 1 / 16000)
        band_db.append(
            [10 * np.log10(spectrum[(freqs >= lo) & (freqs < hi)].sum()) for lo, hi in pairwise(edges)]
        )
    difference = np.abs(np.array(band_db[0]) - np.array(band_db[1]))
    assert difference.max() <= 0.1, difference  # naive decimation misses by 5 dB up top


def test_reframer_owns_its_samples_and_resampler_restarts_after_flush():
    reframer = Reframer(8000, 20)
    buffer = np.arange(200, dtype=np.int16)
    frames = reframer.push(buffer)
    buffer[:] = 0  # the caller reuses its buffer
    assert frames[0].samples[5] == 5
    r = Resampler(8000, 16000)
    first = np.concatenate([r.process(tone(8000, 0.2)), r.flush()])
    second = np.concatenate([r.process(tone(8000, 0.2)), r.flush()])
    assert np.array_equal(first, second)
