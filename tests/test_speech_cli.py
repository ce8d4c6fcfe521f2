"""`duplex say`, `duplex transcribe` and `duplex bench` as a user runs them."""

import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from audio_io.resample import resample
from audio_io.wav import write_wav
from benchmarks.speech_set import SENTENCES, wer
from tests.audio_files import FORMATS, write_audio
from tests.conftest import duplex_command

# transcription needs no pace: its tests run beside the paced ones in make test
# (tests/lanes.py); `duplex bench tts` reports a real-time factor, so it stays paced
pytestmark = pytest.mark.slow


def run(
    args: list[str], env: dict[str, str], timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        duplex_command(*args), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


@pytest.mark.background
def test_say_then_transcribe(tmp_path: Path, offline_env):
    out = tmp_path / "q.wav"
    text = "Could you tell me what the weather will be like tomorrow in Boston?"
    said = run(["say", text, "-o", str(out), "--rate", "44100"], offline_env)
    assert said.returncode == 0, said.stderr
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (44100, 1, 2)
        assert w.getnframes() > 44100
    heard = run(["transcribe", str(out)], offline_env)
    assert heard.returncode == 0, heard.stderr
    assert wer([(text, heard.stdout)]) <= 0.1, heard.stdout


@pytest.mark.background
def test_transcribe_with_partials_streams_to_stderr(tmp_path: Path, offline_env, speech_set):
    gap = np.zeros(16000, np.int16)
    audio = np.concatenate([gap, speech_set[0].audio, gap, speech_set[4].audio, gap])
    write_wav(tmp_path / "two.wav", resample(audio, 16000, 8000), 8000)  # another rate on purpose
    result = run(["transcribe", "--partials", str(tmp_path / "two.wav")], offline_env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("final:") == 2 and "committed:" in result.stderr
    assert wer([(f"{SENTENCES[0]} {SENTENCES[4]}", result.stdout)]) <= 0.15, result.stdout


@pytest.mark.background
def test_a_ten_minute_wav_is_transcribed(tmp_path: Path, offline_env, speech_set):
    gap = np.zeros(8000, np.int16)
    one_pass = np.concatenate([np.concatenate([u.audio, gap]) for u in speech_set])
    repeats = int(np.ceil(600 * 16000 / one_pass.size))
    write_wav(tmp_path / "long.wav", np.tile(one_pass, repeats)[: 600 * 16000], 16000)
    result = run(["transcribe", str(tmp_path / "long.wav")], offline_env, timeout=600)
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert len(words) > 1000  # ten minutes of continuous sentences
    assert "Boston" in result.stdout and "dragon" in result.stdout


@pytest.mark.background
@pytest.mark.parametrize("suffix", FORMATS)
def test_transcribe_reads_the_formats_people_have(
    tmp_path: Path, offline_env, speech_set, asr_engine, suffix: str
):
    """Stereo files at 22.05-48 kHz, written by FFmpeg's and sox's encoders, read by
    the real ASR through `duplex transcribe`: it hears in each what it hears in the
    lossless 16 kHz original (and that is the sentence, give or take Whisper tiny's slips)."""
    long = [i for i, sentence in enumerate(SENTENCES) if len(sentence.split()) >= 10]
    i = long[FORMATS.index(suffix) % len(long)]  # a different sentence for each format
    said = np.concatenate([speech_set[i].audio, np.zeros(8000, np.int16)])
    source = resample(said, 16000, 22050)
    path = write_audio(tmp_path / f"said.{suffix}", source, source, 22050)
    result = run(["transcribe", str(path)], offline_env)
    assert result.returncode == 0, result.stderr
    heard = asr_engine.transcribe(said)
    assert wer([(heard, result.stdout)]) <= 0.1, (heard, result.stdout)
    assert wer([(SENTENCES[i], result.stdout)]) <= 0.25, (SENTENCES[i], result.stdout)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.wav", b"", "empty file (0 bytes)"),
        ("notes.mp3", b"these are words, not sound\n" * 50, "not audio the decoders can read"),
        ("notes.txt", b"these are words, not sound\n" * 50, "no audio stream in it"),
        ("torn.wav", b"RIFF....WAVEdata", "not audio the decoders can read"),
        ("missing.flac", None, "no such file"),
    ],
)
def test_transcribe_what_is_not_audio_exits_2_in_words(tmp_path: Path, offline_env, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    result = run(["transcribe", str(path)], offline_env)
    assert result.returncode == 2 and f"duplex: error: {path}: {message}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_say_nothing_is_an_error(tmp_path: Path, offline_env):
    result = run(["say", "   ", "-o", str(tmp_path / "x.wav")], offline_env)
    assert result.returncode == 2 and "empty text" in result.stderr


def test_bench_tts_prints_json_last(tmp_path: Path, offline_env):
    """Run elsewhere than the checkout, with a configuration file named relative to
    there: the checkout's benchmarks measure, and the file is found."""
    (tmp_path / "bench.toml").write_text('log_level = "warning"\n')
    result = run(
        ["bench", "tts", "--sessions", "1", "--quick", "--config", "bench.toml"], offline_env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["first_audio_ms"]["p50"] > 0 and 0 < report["rtf"] < 1
    assert set(report["sessions"]) == {"1"}


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(tmp_path: Path, offline_env):
    """An installed wheel has no benchmarks/ beside its package (here: the package's
    checkout pointed at an empty directory): exit 2, in words, nothing run."""
    code = (
        "import pathlib, sys, duplex.cli as cli; cli.CHECKOUT = pathlib.Path(sys.argv[1]); "
        "raise SystemExit(cli.main(sys.argv[2:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), "bench", "tts", "--quick"],
        env=offline_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "duplex: error: benchmarks ship with the source checkout" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
