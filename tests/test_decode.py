"""audio_io.decode: files of every format the installed encoders write, made here by
FFmpeg (PyAV) and sox, come back as mono 16 kHz int16 holding what was put in; what is
not audio gets an `AudioFileError` in words."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from audio_io.decode import AudioFileError, decode_audio
from audio_io.wav import write_wav
from tests.audio_files import FORMATS, write_audio

RATE = 22050  # the sources' rate: neither the files' nor the runtime's


def tone(hz: float, seconds: float = 2.0, amplitude: int = 8000) -> npt.NDArray[np.int16]:
    t = np.arange(round(seconds * RATE)) / RATE
    return (np.sin(2 * np.pi * hz * t) * amplitude).astype(np.int16)


def peaks(audio: npt.NDArray[np.int16], rate: int, n: int) -> list[float]:
    """The ``n`` strongest frequencies (Hz) of a one-second window from the middle."""
    window = audio[audio.size // 2 - rate // 2 : audio.size // 2 + rate // 2].astype(np.float64)
    spectrum = np.abs(np.fft.rfft(window * np.hanning(window.size)))
    freqs = np.fft.rfftfreq(window.size, 1 / rate)
    found: list[float] = []
    for i in np.argsort(spectrum)[::-1]:
        if all(abs(freqs[i] - f) > 20 for f in found):
            found.append(float(freqs[i]))
        if len(found) == n:
            return sorted(found)
    raise AssertionError("fewer peaks than asked for")


@pytest.mark.parametrize("suffix", FORMATS)
def test_each_format_comes_back_mono_16k_with_both_channels_mixed(tmp_path: Path, suffix: str):
    path = write_audio(tmp_path / f"tones.{suffix}", tone(440), tone(1000), RATE)
    audio = decode_audio(path, 16000)
    assert audio.dtype == np.int16 and audio.ndim == 1
    # two seconds, give or take an encoder's priming and padding (AAC adds ~1024 samples)
    assert abs(audio.size - 32000) <= 1200, audio.size
    low, high = peaks(audio, 16000, 2)
    assert abs(low - 440) <= 3 and abs(high - 1000) <= 3, (low, high)  # left and right both in
    level = np.sqrt(np.mean(audio[4000:28000].astype(np.float64) ** 2))
    # each tone's RMS is 8000/sqrt(2) per channel, halved by the down-mix: ~4000 together
    assert 3000 < level < 5000, level


def test_the_down_mix_averages_the_channels(tmp_path: Path):
    left = tone(440)
    path = write_audio(tmp_path / "opposed.flac", left, (-left.astype(np.int32)).astype(np.int16), RATE)
    assert np.abs(decode_audio(path, 16000)).max() <= 2  # opposite channels cancel, not pick one


def test_the_rate_asked_for_is_the_rate_given(tmp_path: Path):
    path = write_audio(tmp_path / "a.mp3", tone(300), tone(300), RATE)
    audio = decode_audio(path, 8000)
    assert abs(audio.size - 16000) <= 1200
    assert abs(peaks(audio, 8000, 1)[0] - 300) <= 3


def test_wav_decodes_as_the_project_writes_it(tmp_path: Path):
    samples = tone(500, seconds=1.0)
    write_wav(tmp_path / "plain.wav", samples, RATE)
    audio = decode_audio(tmp_path / "plain.wav", RATE)  # no conversion: the samples themselves
    assert np.array_equal(audio, samples)


def test_a_video_file_gives_its_sound(tmp_path: Path):
    import av

    path = tmp_path / "clip.mkv"
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("ffv1", rate=10)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        sound = container.add_stream("flac", rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone(700)[None, :], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, 0, Fraction(1, RATE)
        for packet in [*sound.encode(frame), *sound.encode(None)]:
            container.mux(packet)
        for i in range(20):
            image = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 10, np.uint8), format="rgb24")
            image = image.reformat(format="yuv420p")
            image.pts = i
            for packet in video.encode(image):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
    assert abs(peaks(decode_audio(path, 16000), 16000, 1)[0] - 700) <= 3


WORDS = "these are words, not sound\n" * 50
UNREADABLE = "not audio the decoders can read"


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("missing.mp3", lambda p: None, "no such file"),
        ("empty.mp3", lambda p: p.write_bytes(b""), "empty file"),
        ("folder.mp3", lambda p: p.mkdir(), "is a directory"),
        ("notes.mp3", lambda p: p.write_text(WORDS), UNREADABLE),
        ("notes.txt", lambda p: p.write_text(WORDS), "no audio stream in it"),  # FFmpeg reads it as video
        ("bytes.ogg", lambda p: p.write_bytes(bytes(range(256)) * 40), UNREADABLE),
        ("cut.wav", lambda p: p.write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt "), UNREADABLE),
    ],
)
def test_what_is_not_audio_is_an_audio_file_error(tmp_path: Path, name: str, make, message: str):
    path = tmp_path / name
    make(path)
    with pytest.raises(AudioFileError, match=message) as raised:
        decode_audio(path, 16000)
    assert str(raised.value).startswith(str(path))


def test_a_file_cut_short_gives_what_it_holds_or_says_where_it_broke(tmp_path: Path):
    for suffix in ("mp3", "flac"):
        whole = write_audio(tmp_path / f"whole.{suffix}", tone(440, seconds=4), tone(440, seconds=4), RATE)
        (tmp_path / f"cut.{suffix}").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    audio = decode_audio(tmp_path / "cut.mp3", 16000)  # MP3 is a run of frames: the first half plays
    assert abs(audio.size - 32000) <= 1200, audio.size
    with pytest.raises(AudioFileError, match=r"cut.flac: corrupt audio after 1\.[0-9]+ s"):
        decode_audio(tmp_path / "cut.flac", 16000)  # FLAC's decoder refuses the torn last frame
