"""benchmarks.run (`make bench`): its BENCH_* settings live beside the strict DUPLEX_*
configuration reader without tripping it, and that reader still refuses what it does
not know."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import wave
import zipfile

import numpy as np
import pytest

from benchmarks.run import NAMES, SettingError, benchmarks
from duplex.config import ConfigError, load_config
from tests.conftest import REPO

BENCH_ENV = {"BENCH_TURNS": "7", "BENCH_SOAK_CYCLES": "20", "BENCH_SOAK_MINUTES": "0.5"}


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEX_", "BENCH_"))}
    return env | {"HF_HUB_OFFLINE": "1"} | extra


def test_settings_become_the_benchmarks_flags():
    flags = benchmarks(BENCH_ENV)
    assert list(flags) == list(NAMES)
    assert flags["conversation"] == ["--turns", "7"]
    assert flags["soak"] == ["--cycles", "20", "--minutes", "0.5"]
    assert benchmarks({})["conversation"] == ["--turns", "100"]  # the defaults


def test_the_configuration_reader_takes_the_bench_settings_and_its_own():
    config = load_config(None, BENCH_ENV | {"DUPLEX_PORT": "8123"}, {})
    assert config.port == 8123


@pytest.mark.parametrize("variable", ["DUPLEX_PROT", "DUPLEX_BENCH_TURNS"])
def test_the_configuration_reader_still_refuses_unknown_duplex_variables(variable: str):
    with pytest.raises(ConfigError, match=f"{variable} .*unknown configuration variable"):
        load_config(None, BENCH_ENV | {variable: "5"}, {})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DUPLEX_BENCH_TURNS": "5"}, "DUPLEX_BENCH_TURNS is now BENCH_TURNS"),
        ({"BENCH_TURNS": "lots"}, "BENCH_TURNS='lots': expected a whole number above 0"),
        ({"BENCH_TURNS": "0"}, "BENCH_TURNS='0': expected a whole number above 0"),
        ({"BENCH_SOAK_MINUTES": "-1"}, "BENCH_SOAK_MINUTES='-1': expected a number above 0"),
    ],
)
def test_a_wrong_setting_is_refused_before_anything_runs(env: dict[str, str], message: str):
    with pytest.raises(SettingError, match=message):
        benchmarks(env)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run"],
        env=child_env(**env),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "make bench: " in done.stderr and message in done.stderr, done.stderr
    assert "==" not in done.stdout and "Traceback" not in done.stderr  # no benchmark started


def test_a_benchmark_process_starts_with_the_bench_settings_in_its_environment():
    """What `make bench` starts for the conversation benchmark: its configuration and
    flags, read by the real reader and parser in a process whose environment holds the
    BENCH_* settings and a DUPLEX_* key (the process `make bench` exited 2 in before)."""
    script = (
        "from benchmarks.common import stage_config\n"
        "from benchmarks.run import benchmarks\n"
        "import os\n"
        "config, args = stage_config('conversation', benchmarks(os.environ)['conversation'])\n"
        "print(args.turns, config.port)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(**BENCH_ENV, DUPLEX_PORT="8123"),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7", "8123"]


def test_each_utterance_is_measured_against_its_own_reply():
    """`duplex bench conversation` pairs each utterance with the first reply created
    after it began, not after its voice ended: a turn judged over in a pause (or a
    recording whose quiet tail counts as voiced) has its reply created before that, and
    the next utterance's reply, seconds later, was taken for it."""
    from benchmarks.caller import Received, VirtualCaller
    from benchmarks.conversation import replies_to_utterances
    from duplex import events as ev
    from duplex.events import Event

    caller = VirtualCaller()
    caller.voice_spans = [(1.0, 2.5), (10.0, 11.0)]
    caller.events = [
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_1"}, 2.4),  # before the tail's end
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_2"}, 11.3),
    ]
    caller.frames = [Received(2.8, "resp_1", 480), Received(11.5, "resp_2", 480)]
    assert replies_to_utterances(caller) == [(0, "resp_1", 2.8, 2.5), (1, "resp_2", 11.5, 11.0)]
    # an utterance with no reply of its own (a backchannel over one) is not measured
    caller.voice_spans.insert(1, (5.0, 5.4))
    assert [k for k, *_ in replies_to_utterances(caller)] == [0, 2]


def test_the_caller_waits_for_the_reply_to_its_words_not_the_one_they_cut():
    """`UntilReplyDone` after an interrupting line: the cut reply's response.done comes
    after the line ends (it is judged at its end), and was taken for the answer, so the
    next request was said over the answer and interrupted it (the bench counted 184
    barge-ins at 8 sessions where its script has 105 lines)."""
    from benchmarks.caller import VirtualCaller
    from duplex import events as ev
    from duplex.events import Event

    def told(caller: VirtualCaller, *events: Event) -> None:  # as the session tells it (`Sink.event`)
        caller.voice_spans, caller.speech_ends = [(3.5, 4.8)], [5.0]  # the interrupting line, voiced, ended
        for event in events:
            caller.event(event)

    caller = VirtualCaller()
    told(
        caller,
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_1"}, 1.0),  # the story
        Event(ev.RESPONSE_DONE, {"response_id": "resp_1", "status": "cancelled"}, 5.3),  # cut by it
    )
    assert not caller._replied()
    told(
        caller,
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_2"}, 5.6),  # the answer to the line
        Event(ev.RESPONSE_DONE, {"response_id": "resp_2", "status": "completed"}, 8.0),
    )
    assert caller._replied()
    # a reply talked over that resumed (a backchannel) and played out is done too
    caller = VirtualCaller()
    told(
        caller,
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_1"}, 1.0),
        Event(ev.RESPONSE_DONE, {"response_id": "resp_1", "status": "completed"}, 9.0),
    )
    assert caller._replied()


def test_a_line_said_when_no_reply_plays_or_as_one_ends_is_not_a_missed_interruption():
    from benchmarks.caller import Received, VirtualCaller
    from benchmarks.conversation import _played_on
    from duplex import events as ev
    from duplex.events import Event

    def frames(rid: str, start: float, end: float) -> list[Received]:
        return [Received(start + 0.02 * k, rid, 480) for k in range(round((end - start) / 0.02))]

    caller = VirtualCaller()
    caller.events = [
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_1"}, 1.0),
        Event(ev.RESPONSE_DONE, {"response_id": "resp_1", "status": "completed"}, 3.0),
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_2"}, 6.0),  # no done yet: still playing
        Event(ev.RESPONSE_CREATED, {"response_id": "resp_3"}, 10.0),  # paused at 11 s, cut at 12 s
        Event(ev.RESPONSE_DONE, {"response_id": "resp_3", "status": "cancelled"}, 12.0),
    ]
    caller.frames = frames("resp_1", 1.2, 2.9) + frames("resp_2", 6.3, 7.5) + frames("resp_3", 10.2, 11.0)
    onsets = (1.1, 2.0, 2.6, 4.0, 6.2, 6.9, 10.3, 11.5)
    assert [_played_on(caller, t) for t in onsets] == [False, True, False, False, False, True, True, False]


def test_a_pause_is_a_self_interruption_only_with_no_caller_audio_before_it():
    from benchmarks.caller import VirtualCaller
    from benchmarks.conversation import CALLER_REACH_S, _self_interruptions

    caller = VirtualCaller()
    caller.sound_spans = [(5.0, 6.0)]
    assert _self_interruptions(caller, [4.9, 5.2, 6.0 + CALLER_REACH_S - 0.01]) == 1  # before the voice
    assert _self_interruptions(caller, [6.0 + CALLER_REACH_S + 0.01, 9.0]) == 2  # long after it


def tone(seconds: float, db: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return np.sin(2 * np.pi * 220 * t) * 10 ** (db / 20) * 32767 * np.sqrt(2)


def noise(seconds: float, db: float, rng: np.random.Generator, rate: int = 16000) -> np.ndarray:
    return rng.standard_normal(round(seconds * rate)) * 10 ** (db / 20) * 32767


def test_a_recordings_room_noise_is_not_taken_for_its_voice():
    from benchmarks.caller import Speak

    rng = np.random.default_rng(0)
    voice = np.concatenate(
        [noise(0.3, -60, rng), tone(0.5, -20) + noise(0.5, -60, rng), noise(0.2, -60, rng)]
    )
    assert Speak(voice.astype(np.int16)).voiced() == pytest.approx((0.3, 0.8), abs=0.011)
    synthesized = np.concatenate([np.zeros(4800), tone(0.5, -20), np.zeros(3200)])  # digital silence
    assert Speak(synthesized.astype(np.int16)).voiced() == pytest.approx((0.3, 0.8), abs=0.011)


def test_recorded_interruptions_are_cut_faded_and_as_loud_as_the_synthesized_ones(tmp_path, tts_engine):
    from benchmarks.interruptions import RECORDED, SYNTHESIZED, interrupting_lines, voiced_level_db

    assert RECORDED  # the loops below run
    rng = np.random.default_rng(1)
    members: dict[tuple[str, str], np.ndarray] = {}
    for line in RECORDED:  # stand-ins for the two wheels' WAVs: a tone in room noise where each line is
        assert line.recording is not None
        key = (line.recording.wheel, line.recording.member)
        audio = members.setdefault(key, noise(30.0, -60, rng))
        start, end = (
            round((line.recording.start_s + 0.1) * 16000),
            round((line.recording.end_s - 0.1) * 16000),
        )
        audio[start:end] += tone((end - start) / 16000, -35)
    for (wheel, member), audio in members.items():
        body = io.BytesIO()
        with wave.open(body, "wb") as wav:
            wav.setparams((1, 2, 16000, 0, "NONE", "not compressed"))
            wav.writeframes(audio.astype("<i2").tobytes())
        with zipfile.ZipFile(tmp_path / f"{wheel}py3-none-any.whl", "w") as zipped:
            zipped.writestr(member, body.getvalue())

    clips, lines = interrupting_lines(tts_engine, tmp_path)
    assert lines == [*SYNTHESIZED, *RECORDED] and set(clips) == {line.label for line in lines}
    target = np.mean([voiced_level_db(clips[line.label].samples) for line in SYNTHESIZED])
    for line in RECORDED:
        clip = clips[line.label]
        assert voiced_level_db(clip.samples) == pytest.approx(target, abs=0.5)
        assert clip.voiced()[0] == pytest.approx(0.1, abs=0.011)  # the tone, not the noise before it
        assert abs(int(clip.samples[0])) < 30 and abs(int(clip.samples[-1])) < 30  # faded: no click
    # without the wheels: the synthesized lines alone
    clips, lines = interrupting_lines(tts_engine, tmp_path / "absent")
    assert lines == list(SYNTHESIZED) and len(clips) == len(SYNTHESIZED)


def test_an_audio_gap_counts_only_where_no_caller_voice_paused_the_reply():
    from benchmarks.caller import Received, VirtualCaller
    from benchmarks.conversation import _audio_gaps

    caller = VirtualCaller()
    times = [1.0 + 0.02 * k for k in range(50)]  # 1.0-1.98 s, then two silences of 0.3 s
    times += [2.28 + 0.02 * k for k in range(50)] + [3.56 + 0.02 * k for k in range(10)]
    caller.frames = [Received(t, "resp_1", 480) for t in times]
    assert _audio_gaps(caller) == 2
    caller.voice_spans = [(3.3, 3.5)]  # the caller spoke in the second: it paused the reply
    assert _audio_gaps(caller) == 1


def test_end_of_turn_scores_are_reported_as_probabilities_not_rounded_to_a_tenth():
    from benchmarks.conversation import _end_of_turn

    turns = [{"silence_waited_ms": 300.0, "end_of_turn_score": p} for p in (0.9437, 0.9855, 0.0428)]
    turns.append({"silence_waited_ms": 500.0})  # a turn not judged
    summary = _end_of_turn([{"breakdowns": turns}])
    assert summary["score"] == {"p50": 0.944, "p95": 0.981, "n": 3}
    assert summary["scores"] == [0.0428, 0.9437, 0.9855]
    assert summary["silence_waited_ms"]["n"] == 4
