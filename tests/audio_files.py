"""Audio files in the formats people have, made at test time by real encoders: FFmpeg's
(through PyAV) and sox's. Stereo and at rates other than the runtime's, on purpose."""

from __future__ import annotations

import subprocess
from pathlib import Path

import av
import numpy as np
import numpy.typing as npt

from audio_io.resample import resample
from audio_io.wav import write_wav

# suffix: (PyAV container format, codec, rate); these formats come from FFmpeg's encoders
FFMPEG_FORMATS = {
    "mp3": ("mp3", "libmp3lame", 44100),
    "opus.ogg": ("ogg", "libopus", 48000),
    "m4a": ("ipod", "aac", 44100),
    "flac": ("flac", "flac", 44100),
    "webm": ("webm", "libopus", 48000),
    "wav": ("wav", "pcm_s24le", 44100),
}
# and these from sox's (libvorbis, libsndfile)
SOX_FORMATS = {"vorbis.ogg": 44100, "aiff": 22050}
FORMATS = [*FFMPEG_FORMATS, *SOX_FORMATS]


def write_audio(path: Path, left: npt.NDArray[np.int16], right: npt.NDArray[np.int16], rate: int) -> Path:
    """A stereo file of the format its suffix names (a key of `FORMATS`), from int16
    channels at ``rate``."""
    suffix = path.name.split(".", 1)[1]
    if suffix in SOX_FORMATS:
        wav = path.with_name(path.name + ".src.wav")
        write_wav(wav, left, rate)  # sox joins two mono WAVs into one stereo file
        wav_right = path.with_name(path.name + ".right.wav")
        write_wav(wav_right, right, rate)
        subprocess.run(
            ["sox", "-M", str(wav), str(wav_right), "-r", str(SOX_FORMATS[suffix]), str(path)],
            check=True,
            capture_output=True,
        )
        return path
    container_format, codec, out_rate = FFMPEG_FORMATS[suffix]
    planar = np.stack([resample(left, rate, out_rate), resample(right, rate, out_rate)])
    with av.open(str(path), mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=out_rate, layout="stereo")
        assert isinstance(stream, av.AudioStream)
        frame = av.AudioFrame.from_ndarray(planar.T.reshape(1, -1).copy(), format="s16", layout="stereo")
        frame.sample_rate = out_rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path
