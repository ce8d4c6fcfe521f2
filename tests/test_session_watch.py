"""`WatchedSink`: watchers are told of a session's events, before its transport, within
their bound; audio, flushes and reply ends are the transport's alone."""

from __future__ import annotations

import numpy as np

from audio_io.frame import AudioFrame
from duplex.events import Event
from duplex.session_watch import WatchedSink


class Recording:
    """A transport's sink that records what it is given."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def audio(self, frame: AudioFrame, response_id: str) -> None:
        self.log.append(f"sink audio {response_id}")

    def event(self, event: Event) -> None:
        self.log.append(f"sink {event.type}")

    def flush(self) -> None:
        self.log.append("sink flush")

    def end_reply(self, response_id: str, completed: bool) -> None:
        self.log.append(f"sink end {response_id}")


def test_watchers_see_events_first_within_their_bound_until_they_leave():
    log: list[str] = []
    sink = WatchedSink(Recording(log))
    first = sink.watch(lambda e: log.append(f"first {e.type}"), limit=2)
    second = sink.watch(lambda e: log.append(f"second {e.type}"), limit=2)
    assert first is not None and second is not None
    assert sink.watch(lambda e: log.append("third"), limit=2) is None  # no room: not told
    sink.event(Event("a", {}))
    sink.audio(AudioFrame(np.zeros(480, np.int16), 24000), "resp_1")
    sink.flush()
    sink.end_reply("resp_1", completed=True)
    first()
    first()  # idempotent
    sink.event(Event("b", {}))
    assert log == [
        "first a",
        "second a",
        "sink a",
        "sink audio resp_1",
        "sink flush",
        "sink end resp_1",
        "second b",
        "sink b",
    ]
    assert sink.watch(lambda e: None, limit=2) is not None  # room again
