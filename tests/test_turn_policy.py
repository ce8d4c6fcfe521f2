"""Turn-taking decisions on tables of cases: words, levels, times and settings in, a
verdict out (no models, no clock)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from duplex.events import SessionError
from duplex.session_config import JUDGED_PAUSE_MS, SessionConfig
from duplex.turn_policy import (
    JUDGING_DECAY,
    QUICK_PAUSE_CONFIRM_S,
    QUICK_PAUSE_FLOOR_DB,
    QUICK_PAUSE_OVER_ROOM_DB,
    Over,
    QuickPause,
    Turn,
    Verdict,
    finished_turn,
    in_pause,
    is_backchannel,
    is_echo_of,
    judge_interruption,
    judgement_in_time,
    judging_ms,
    quick_pause,
    restart_at,
    should_speculate,
    silence_to_end,
    speech_over_reply,
    turn_over,
)
from models.vad import VadConfig

SAID = "Once upon a time there was a brave little dragon who lived in a cave"


@pytest.mark.parametrize(
    ("text", "backchannel"),
    [
        ("", True),  # no words at all
        ("Uh-huh.", True),
        ("okay, yeah", True),
        ("Mm-hmm", True),
        ("Thank you.", True),  # Whisper on a short hum
        ("Then, then, then, then,", True),  # Whisper looping on a hum
        ("no no", False),  # a word said twice is not a loop
        ("Okay, stop.", False),
        ("Wait", False),
        ("What is two plus two?", False),
    ],
)
def test_backchannels(text: str, backchannel: bool) -> None:
    assert is_backchannel(text) is backchannel


@pytest.mark.parametrize(
    ("heard", "spoken", "echo"),
    [
        ("a brave little dragon", SAID, True),
        ("brave little dragon lived", SAID, True),  # a word lost on the way back
        ("a brave dragon, stop now", SAID, True),  # 3 of 5 words are the reply's: 0.6
        ("a dragon, stop now please", SAID, False),  # 2 of 5
        ("stop, what is two plus two", SAID, False),
        ("dragon little brave a", SAID, False),  # the same words, out of order
        ("", SAID, False),
        ("a brave little dragon", "", False),  # nothing said lately
    ],
)
def test_echo_of_the_replys_own_words(heard: str, spoken: str, echo: bool) -> None:
    assert is_echo_of(heard, spoken) is echo


FLOOR, OVER = QUICK_PAUSE_FLOOR_DB, QUICK_PAUSE_OVER_ROOM_DB
CONFIRM = QUICK_PAUSE_CONFIRM_S


@pytest.mark.parametrize(
    ("level", "room", "paused_at", "paused", "holdoff", "now", "verdict"),
    [
        (-20.0, -60.0, None, False, 0.0, 10.0, QuickPause.LOUD),  # far over a quiet room
        (-60.0 + OVER, -60.0, None, False, 0.0, 10.0, QuickPause.LOUD),  # just over the room
        (-60.0 + OVER - 0.1, -60.0, None, False, 0.0, 10.0, QuickPause.NONE),  # just under
        (-30.0, -40.0, None, False, 0.0, 10.0, QuickPause.NONE),  # a noisy room
        (FLOOR - 1, -math.inf, None, False, 0.0, 10.0, QuickPause.NONE),  # silence: under the floor
        (FLOOR, -math.inf, None, False, 0.0, 10.0, QuickPause.LOUD),
        (-20.0, -60.0, None, True, 0.0, 10.0, QuickPause.NONE),  # paused anyway
        (-20.0, -60.0, None, False, 10.5, 10.0, QuickPause.NONE),  # held off after a false alarm
        (-20.0, -60.0, None, False, 10.0, 10.0, QuickPause.LOUD),  # the hold-off is over
        (-20.0, -60.0, 10.0, True, 0.0, 10.0 + CONFIRM, QuickPause.NONE),  # the VAD still may confirm
        (-20.0, -60.0, 10.0, True, 0.0, 10.0 + CONFIRM + 0.01, QuickPause.FALSE_ALARM),
        (-90.0, -90.0, 10.0, True, 0.0, 10.3, QuickPause.FALSE_ALARM),  # whatever the level
    ],
)
def test_quick_pause(
    level: float,
    room: float,
    paused_at: float | None,
    paused: bool,
    holdoff: float,
    now: float,
    verdict: QuickPause,
) -> None:
    assert quick_pause(level, room, paused_at, paused, holdoff, now) is verdict


@pytest.mark.parametrize(
    ("caller_heard", "playing", "barge_in", "over"),
    [
        (False, True, True, Over.ECHO),
        (False, False, True, Over.ECHO),  # the echo of a reply that just ended
        (False, True, False, Over.ECHO),
        (True, True, True, Over.INTERRUPTION),
        (True, True, False, Over.TURN),  # a reply the caller may not cut
        (True, False, True, Over.TURN),  # no reply playing (ended, or still being thought)
        (True, False, False, Over.TURN),
    ],
)
def test_speech_over_the_reply(caller_heard: bool, playing: bool, barge_in: bool, over: Over) -> None:
    assert speech_over_reply(caller_heard, playing, barge_in) is over


@pytest.mark.parametrize(
    ("words", "said", "ended", "resume", "verdict"),
    [
        # heard so far, the utterance going on
        ("", SAID, False, True, Verdict.WAIT),
        ("uh-huh", SAID, False, True, Verdict.WAIT),
        ("okay", SAID, False, False, Verdict.WAIT),
        ("stop", SAID, False, True, Verdict.BARGE_IN),
        ("wait, what", SAID, False, True, Verdict.BARGE_IN),
        ("a brave little dragon", SAID, False, True, Verdict.ECHO),
        ("a", SAID, False, True, Verdict.WAIT),  # one common word of the reply's: too few to tell
        ("a dragon", SAID, False, True, Verdict.WAIT),
        ("a, at least you know", SAID, False, True, Verdict.BARGE_IN),  # an echo word, then the caller
        ("a brave little dragon", "", False, True, Verdict.BARGE_IN),  # nothing said lately
        # the utterance has ended
        ("", SAID, True, True, Verdict.RESUME),  # a cough: the reply goes on
        ("", SAID, True, False, Verdict.BARGE_IN),  # ... unless told to cut it anyway
        ("Mm-hmm.", SAID, True, True, Verdict.RESUME),
        ("Mm-hmm.", SAID, True, False, Verdict.RESUME),  # a backchannel resumes regardless
        ("stop please", SAID, True, True, Verdict.BARGE_IN),
        ("little dragon who lived", SAID, True, True, Verdict.ECHO),
        ("a dragon", SAID, True, True, Verdict.ECHO),  # all there is, and the reply's words
        ("little dragon who lived", None, True, True, Verdict.BARGE_IN),  # the reply has ended
        ("", None, True, True, Verdict.RESUME),
    ],
)
def test_judge_interruption(
    words: str, said: str | None, ended: bool, resume: bool, verdict: Verdict
) -> None:
    assert judge_interruption(words, said, ended, resume) is verdict


@pytest.mark.parametrize(
    ("text", "over_said", "answer_turns", "turn"),
    [
        ("", None, True, Turn.NONE),
        ("", SAID, True, Turn.NONE),
        ("What time is it?", None, True, Turn.ANSWER),
        ("What time is it?", None, False, Turn.HOLD),
        ("What time is it?", SAID, True, Turn.AFTER_REPLY),  # over a reply it may not cut
        ("What time is it?", SAID, False, Turn.HOLD),
        ("a brave little dragon", SAID, True, Turn.ECHO),
        ("a brave little dragon", SAID, False, Turn.ECHO),
        ("a brave little dragon", None, True, Turn.ANSWER),  # no reply it came over
    ],
)
def test_finished_turn(text: str, over_said: str | None, answer_turns: bool, turn: Turn) -> None:
    assert finished_turn(text, over_said, answer_turns) is turn


@pytest.mark.parametrize(
    ("speculative", "answer_turns", "interrupting", "replying", "speculate"),
    [
        (True, True, False, False, True),
        (False, True, False, False, False),
        (True, False, False, False, False),
        (True, True, True, False, False),
        (True, True, False, True, False),
    ],
)
def test_should_speculate(
    speculative: bool, answer_turns: bool, interrupting: bool, replying: bool, speculate: bool
) -> None:
    assert should_speculate(speculative, answer_turns, interrupting, replying) is speculate


@pytest.mark.parametrize(
    ("score", "silence_ms"),
    [
        (0.97, 100),  # a question it is nearly sure of: the shortest silence
        (0.95, 100),  # that threshold itself is enough
        (0.94, 200),  # else a finished question: the short silence
        (0.7, 200),
        (0.2, 200),  # the threshold itself is enough
        (0.19, 500),  # words neither finished nor unfinished: the whole silence
        (0.05, 500),  # the unfinished threshold itself is not unfinished
        (0.049, 900),  # "so the thing is,": the long silence
        (0.0, 900),
        (None, 500),  # no score yet (ASR or the LLM still at work, or out): the whole silence
    ],
)
def test_silence_to_end(score: float | None, silence_ms: int) -> None:
    assert silence_to_end(score, 500, ((0.2, 200), (0.95, 100)), 900, 0.05) == silence_ms
    # the order of the rules does not matter: the shortest wait of those passed
    assert silence_to_end(score, 500, ((0.95, 100), (0.2, 200)), 900, 0.05) == silence_ms


@pytest.mark.parametrize(
    ("silence_ms", "judging", "in_time"),
    [
        (200, 50, True),  # a fast machine: the final early in the pause, the judgement soon
        (420, 110, False),  # 2 AVX2 cores: the final at 420 ms, the judgement 110 ms after it
        (390, 110, False),  # the judgement would end exactly when the silence does: no use
        (389, 110, True),
        (0, 0, True),  # no judgement measured yet: asked for
        (500, 0, False),  # the silence has ended the turn already
    ],
)
def test_a_judgement_is_asked_for_only_if_it_can_come_before_the_silence_ends_the_turn(
    silence_ms: float, judging: float, in_time: bool
) -> None:
    assert judgement_in_time(silence_ms, judging, 500) is in_time


def test_the_judgements_time_is_a_weighted_mean_of_those_measured() -> None:
    assert judging_ms(0.0, 110.0, 500) == 110.0  # the first is taken whole
    assert judging_ms(100.0, 200.0, 500) == pytest.approx(130.0)
    assert judging_ms(100.0, 1500.0, 500) == pytest.approx(220.0)  # at most the whole silence
    figure = judging_ms(0.0, 1500.0, 500)  # a judgement on a busy machine
    skipped = 0
    while not judgement_in_time(400, figure, 500):  # each pause not judged lowers the figure
        figure = judging_ms(figure, None, 500)
        skipped += 1
    assert figure == pytest.approx(500 * (1 - JUDGING_DECAY) ** skipped) and 1 <= skipped <= 6


def test_the_session_settings_choose_the_silence_and_the_vad_ends_after_end_of_turn_ms() -> None:
    config = SessionConfig(
        end_of_turn_ms=600, complete_turn_ms=250, certain_turn_ms=150, unfinished_turn_ms=1000
    )
    assert [config.silence_to_end(p) for p in (0.95, 0.5, 0.1, 0.001, None)] == [150, 250, 600, 1000, 600]
    # a surer end never waits longer than a finished one (a client's shorter complete_turn_ms)
    assert SessionConfig(complete_turn_ms=200).silence_to_end(0.95) == 200
    # the VAD ends the utterance after end_of_turn_ms: the session ends it sooner, or has
    # the VAD hold the pause longer (`VadStream.hold_pause`)
    assert config.vad(VadConfig()).min_silence_ms == 600
    silence = replace(config, end_of_turn_by_meaning=False)  # silence alone, whatever the words
    assert [silence.silence_to_end(p) for p in (0.9, 0.001, None)] == [600, 600, 600]
    # a client's longer silence (realtime's silence_duration_ms) holds for unfinished words
    # too, and a shorter one for finished words
    assert SessionConfig(end_of_turn_ms=1200).silence_to_end(0.0) == 1200
    assert SessionConfig(end_of_turn_ms=200).silence_to_end(0.9) == 200


@pytest.mark.parametrize(
    "changes",
    [
        {"complete_turn_ms": 50},
        {"complete_turn_ms": 200.5},
        {"complete_turn_threshold": 1.5},
        {"complete_turn_threshold": "high"},
        {"complete_turn_threshold": True},
        {"certain_turn_ms": 99},
        {"certain_turn_ms": "soon"},
        {"certain_turn_threshold": 2},
        {"certain_turn_threshold": False},
        {"end_of_turn_by_meaning": "yes"},
        {"unfinished_turn_ms": 100},
        {"unfinished_turn_ms": "long"},
        {"unfinished_turn_threshold": -0.1},
        {"unfinished_turn_threshold": None},
    ],
)
def test_bad_end_of_turn_settings_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(SessionError) as refused:
        SessionConfig().changed(changes)
    assert refused.value.code == "bad_config"


def test_the_pause_that_starts_the_turns_judgement_comes_before_the_shortest_silence() -> None:
    base = VadConfig()
    assert SessionConfig().vad(base).pause_ms == JUDGED_PAUSE_MS < base.pause_ms
    assert SessionConfig(end_of_turn_ms=200, end_of_turn_by_meaning=False).vad(base).pause_ms == 192
    assert SessionConfig(end_of_turn_by_meaning=False).vad(base).pause_ms == base.pause_ms
    assert SessionConfig(end_of_turn_ms=300, complete_turn_ms=1000).vad(base).min_silence_ms == 300


@pytest.mark.parametrize(
    ("paused", "pause", "judged_at", "holds"),
    [
        (True, 8000, 8000, True),  # the same pause
        (True, 9600, 8000, False),  # the caller spoke on, and paused again
        (False, 8000, 8000, False),  # the pause is not announced yet, or the utterance ended
        (True, None, 8000, False),
        (True, 8000, None, False),  # nothing was judged
    ],
)
def test_words_and_judgements_hold_only_in_their_own_pause(
    paused: bool, pause: int | None, judged_at: int | None, holds: bool
) -> None:
    assert in_pause(paused, pause, judged_at) is holds


@pytest.mark.parametrize(
    ("needed", "vad", "silence", "echo", "over"),
    [
        (250, 500, 250.0, False, True),  # finished words: the short silence has run
        (250, 500, 230.0, False, False),  # not yet
        (500, 500, 600.0, False, False),  # no shorter than the VAD's own: the VAD ends it
        (800, 500, 900.0, False, False),  # unfinished words: the VAD waits longer (held pause)
        (250, 500, 400.0, True, False),  # speech over the reply, or its echo: the VAD decides
    ],
)
def test_the_turn_is_over_after_the_silence_its_words_need(
    needed: int, vad: int, silence: float, echo: bool, over: bool
) -> None:
    assert turn_over(needed, vad, silence, echo) is over


@pytest.mark.parametrize(
    ("caller_start", "utterance_start", "ignoring", "restart"),
    [
        (12000, 8000, False, 12000),  # the utterance began with echo: from the caller's voice
        (12000, 8000, True, 12000),
        (6400, 8000, True, 8000 - 4800),  # its start was the caller's, taken for echo: from it
        (6400, 8000, False, None),  # transcribed from its start already
        (8000, 8000, False, None),
    ],
)
def test_where_an_utterance_over_the_echo_is_transcribed_from(
    caller_start: int, utterance_start: int, ignoring: bool, restart: int | None
) -> None:
    assert restart_at(caller_start, utterance_start, ignoring, preroll=4800) == restart
