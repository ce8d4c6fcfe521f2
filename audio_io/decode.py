"""Audio files of any format the system's decoders read (FFmpeg's, through PyAV), as
mono int16 PCM at the rate asked for.

WAV, FLAC, MP3, Ogg (Vorbis, Opus), M4A/AAC, WebM and the audio of video files alike:
the first audio stream is decoded and converted by FFmpeg's own resampler (down-mix and
rate in one step), so no format has a path of its own here. What cannot be read raises
`AudioFileError` with the reason in words (missing, empty, not audio, no audio stream,
corrupt), never FFmpeg's exception or a traceback.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import numpy.typing as npt
from av.error import FFmpegError


class AudioFileError(ValueError):
    pass


def decode_audio(path: str | Path, rate: int) -> npt.NDArray[np.int16]:
    """The file's first audio stream as mono int16 samples at ``rate`` Hz."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise AudioFileError(f"{path}: no such file") from None
    except OSError as e:
        raise AudioFileError(f"{path}: {e.strerror or e}") from None
    if path.is_dir():
        raise AudioFileError(f"{path}: is a directory, not an audio file")
    if size == 0:
        raise AudioFileError(f"{path}: empty file (0 bytes)")
    try:
        container = av.open(str(path), mode="r")
    except FFmpegError as e:
        raise AudioFileError(
            f"{path}: not audio the decoders can read: not an audio file, or a damaged one ({_reason(e)})"
        ) from None
    except OSError as e:
        raise AudioFileError(f"{path}: {e.strerror or e}") from None
    with container:
        if not container.streams.audio:
            kind = container.format.long_name or container.format.name
            raise AudioFileError(f"{path}: no audio stream in it (read as {kind})")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        chunks: list[npt.NDArray[np.int16]] = []  # s16 mono: one plane of int16
        try:
            for frame in container.decode(stream):
                chunks += [_samples(out) for out in resampler.resample(frame)]
            chunks += [_samples(out) for out in resampler.resample(None)]
        except FFmpegError as e:
            heard = sum(c.size for c in chunks) / rate
            raise AudioFileError(f"{path}: corrupt audio after {heard:.2f} s ({_reason(e)})") from None
    if not chunks or sum(c.size for c in chunks) == 0:
        raise AudioFileError(f"{path}: its audio stream holds no samples")
    return np.concatenate(chunks)


def _samples(frame: av.AudioFrame) -> npt.NDArray[np.int16]:
    samples = frame.to_ndarray().reshape(-1)
    assert samples.dtype == np.int16, f"the resampler was asked for s16, gave {samples.dtype}"
    return samples.astype(np.int16, copy=False)


def _reason(error: FFmpegError) -> str:
    return str(error.strerror or error).rstrip(".")
