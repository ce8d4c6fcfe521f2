"""`WatchedSink`: a session's `Sink` that also tells others of the session's events, for
`SessionPort.watch` (duplex/port.py): a Realtime client joined to a phone call follows
the call's events while the call's own transport carries its audio.

    Session ─► WatchedSink ─┬─► watchers: each event, in the order they came (none may block)
                            └─► the transport's sink: audio, events, flush, end of reply

Watchers see events only, each before the transport's sink gets it; audio, flushes and
the ends of replies are the transport's alone. The session holds one and hands it to
everything that writes its output, so no transport reaches into the session, its sink
or its output stage to follow it. The bound on watchers is the caller's (``limit``):
no room is an ordinary None.
"""

from __future__ import annotations

from audio_io.frame import AudioFrame
from duplex.events import Event
from duplex.port import Sink, Unwatch, Watcher


class WatchedSink:
    """The transport's sink, with the watchers told of its events first."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self._watchers: list[Watcher] = []

    def watch(self, watcher: Watcher, limit: int) -> Unwatch | None:
        if len(self._watchers) >= limit:
            return None
        self._watchers.append(watcher)

        def unwatch() -> None:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

        return unwatch

    def event(self, event: Event) -> None:
        for watch in list(self._watchers):  # (one may leave as it is told)
            watch(event)
        self.sink.event(event)

    def audio(self, frame: AudioFrame, response_id: str) -> None:
        self.sink.audio(frame, response_id)

    def flush(self) -> None:
        self.sink.flush()

    def end_reply(self, response_id: str, completed: bool) -> None:
        self.sink.end_reply(response_id, completed)
