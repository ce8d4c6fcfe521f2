"""The scripted caller (`benchmarks.caller.VirtualCaller`) that the session tests and
`duplex bench conversation` play: what it waits for. Its sessions here are a test
double that answers on cue; every test with the real session is in test_session.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from audio_io.frame import AudioFrame
from audio_io.pcm import RUNTIME_RATE
from benchmarks.caller import FRAME, Speak, UntilHeard, VirtualCaller
from duplex import events as ev
from duplex.events import Event


class Replies:
    """A session that answers the caller's words with ``reply_s`` of audio, ``after``
    frames of silence after them, all of it at once (the caller plays what arrives)."""

    def __init__(self, caller: VirtualCaller, words_frames: int, reply_s: float, after: int = 5) -> None:
        self.caller, self.words_frames, self.reply_s, self.after = caller, words_frames, reply_s, after
        self.frames = 0

    def push_audio(self, frame: AudioFrame) -> None:
        self.frames += 1
        if self.frames == self.words_frames + self.after:
            self.caller.event(Event(ev.RESPONSE_CREATED, {"response_id": "resp_1"}))
            samples = np.zeros(round(self.reply_s * RUNTIME_RATE), np.int16)
            self.caller.audio(AudioFrame(samples, RUNTIME_RATE), "resp_1")
            if self.reply_s < 1:  # it ends there
                self.caller.end_reply("resp_1", completed=True)


@pytest.mark.parametrize("reply_s", [0.4, 1.4])
async def test_until_heard_waits_for_that_much_of_the_reply_or_its_end(reply_s):
    """The caller interrupts after 1 s of the reply; a reply that ended shorter than
    that does not keep it silent until the timeout (it goes on, as a person would)."""
    caller = VirtualCaller()
    words = Speak(np.full(10 * FRAME, 1000, np.int16))
    session = Replies(caller, words_frames=10, reply_s=reply_s)
    await caller.play(session, [words, UntilHeard(1.0, timeout=3.0)])
    # a 1.4 s reply is heard past 1 s at once; a 0.4 s one has ended: either way the
    # caller goes on at its first frame after the reply came, not 3 s (150 frames) on
    assert session.frames <= 10 + 5 + 2, session.frames


def test_the_loudspeaker_plays_a_run_of_frames_back_to_back():
    """Frames that arrive early or late are played on the grid the server meant them for,
    as a jitter-buffered client plays them: the echo is the reply, sample for sample,
    ``echo_delay_s`` after its first frame was due (here all arrive at once, early)."""
    caller = VirtualCaller(echo_db=0.0, echo_delay_s=0.1)
    caller._start = time.monotonic()  # as `play` sets it
    reply = np.random.default_rng(0).integers(-3000, 3000, 10 * FRAME).astype(np.int16)
    due = caller._start + 0.05
    for k, frame in enumerate(reply.reshape(-1, FRAME)):
        caller.audio(AudioFrame(frame, RUNTIME_RATE, playout_time=due + 0.02 * k), "resp_1")
    at = round((due + 0.1 - caller._start) * RUNTIME_RATE)
    assert np.array_equal(np.rint(caller._echo[at : at + reply.size]), reply)
    assert not np.any(caller._echo[:at]) and not np.any(caller._echo[at + reply.size :])


async def test_a_reply_begun_in_the_quiet_tail_of_the_words_is_the_reply_to_them():
    """A turn judged over in a pause has its reply created (and it may begin to play)
    while the clip's quiet tail is still going out: that reply is the one to the words,
    and the caller interrupts it on cue, not after the step's timeout."""
    caller = VirtualCaller()
    tail = np.zeros(10 * FRAME, np.int16)
    words = Speak(np.concatenate([np.full(10 * FRAME, 1000, np.int16), tail]))
    session = Replies(caller, words_frames=10, reply_s=1.4)
    await caller.play(session, [words, UntilHeard(1.0, timeout=3.0)])
    (created,) = caller.of_type(ev.RESPONSE_CREATED)
    assert created.at < caller.speech_ends[-1]  # in the tail, before the step ended
    assert session.frames <= 20 + 2, session.frames  # not 150 frames (3 s) on
