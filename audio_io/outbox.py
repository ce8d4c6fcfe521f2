"""`Outbox`: what waits to go out on one connection, in order, bounded.

    put_frame(items) ─┐                               ┌─► get() / take()  (a writer: WebSocket, gRPC)
    put(items) ───────┼─► [ctl][aud][aud][mark][ctl] ─┤
                      │                               └─► next_audio()    (a clock: RTP, a media track)
    drop_audio() ─────┘   removes every audio entry (a barge-in), keeps the rest

Two kinds of entry: audio (a frame of reply audio, and what belongs to it, such as a
Twilio mark) and control (events, a Twilio ``clear``). Audio beyond ``max_frames``
is dropped as it comes (a reader slower than real time loses audio, never memory);
control beyond ``max_control`` sets `overflowed` and is dropped: a reader that reads
nothing at all, for its transport to end. `stalled_s` says how long entries have waited
with none taken: a writer blocked on a client that stops reading (a full TCP window,
gRPC flow control), for `duplex.transports.link.Link.watch_reader`.

Invariant: ``frames`` is the number of frame entries queued (an audio entry that
starts a frame counts once; the entries that belong to it count zero).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    def __init__(
        self, max_frames: int = 250, max_control: int = 2000, on_drop: Callable[[], None] = lambda: None
    ) -> None:
        self.max_frames = max_frames  # 250: 5 s of 20 ms frames
        self.max_control = max_control
        self._on_drop = on_drop  # a frame dropped for a slow reader (a counter)
        self._entries: collections.deque[tuple[int, T]] = collections.deque()  # (kind, item)
        self.frames = 0
        self._control = 0
        self.overflowed = False
        self.ready = asyncio.Event()  # set while something is queued (or a reader must wake)
        self._progress_at = time.monotonic()  # when an entry was last taken, or the queue last empty

    _CONTROL, _FRAME, _WITH_FRAME = 0, 1, 2

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds entries have been waiting with none taken (0 while empty)."""
        if not self._entries and not self.overflowed:
            return 0.0
        return (time.monotonic() if now is None else now) - self._progress_at

    def _starting(self) -> None:
        if not self._entries:  # an empty queue owes its reader nothing until now
            self._progress_at = time.monotonic()

    def put_frame(self, items: Sequence[T]) -> None:
        """One frame of audio (``items[0]``) and what belongs to it; dropped (and counted)
        when `max_frames` are queued."""
        if not items:
            return
        if self.frames >= self.max_frames:
            self._on_drop()
            return
        self._starting()
        self.frames += 1
        self._entries.append((self._FRAME, items[0]))
        self._entries.extend((self._WITH_FRAME, item) for item in items[1:])
        self.ready.set()

    def put_tail(self, items: Sequence[T]) -> None:
        """Audio entries that follow the frames queued (a reply's last mark): dropped
        with them by a barge-in, not counted as frames."""
        self._entries.extend((self._WITH_FRAME, item) for item in items)
        if items:
            self.ready.set()

    def put(self, items: Sequence[T]) -> None:
        """Control entries (events); dropped, and `overflowed` set, beyond the bound."""
        self._starting()
        for item in items:
            if self._control >= self.max_control:
                self.overflowed = True
                self.ready.set()
                return
            self._control += 1
            self._entries.append((self._CONTROL, item))
        if items:
            self.ready.set()

    def drop_audio(self) -> int:
        """Barge-in: every queued audio entry goes; returns how many frames."""
        dropped = self.frames
        self._entries = collections.deque(e for e in self._entries if e[0] == self._CONTROL)
        self.frames = 0
        if not self._entries:
            self.ready.clear()
        return dropped

    def _pop(self) -> T:
        self._progress_at = time.monotonic()
        kind, item = self._entries.popleft()
        self.frames -= kind == self._FRAME
        self._control -= kind == self._CONTROL
        if not self._entries:
            self.ready.clear()
        return item

    def take(self) -> list[T]:
        """Everything queued, in order."""
        items = [self._pop() for _ in range(len(self._entries))]
        self.ready.clear()
        return items

    async def get(self) -> T:
        """The next entry, waiting for one."""
        while not self._entries:
            self.ready.clear()
            await self.ready.wait()
        return self._pop()

    def next_audio(self) -> T | None:
        """For a transport with its own clock (no control entries in its outbox): the
        next frame, or None if there is none yet."""
        while self._entries:
            kind, item = self._entries[0]
            assert kind != self._CONTROL, "a clocked transport's outbox holds audio only"
            self._pop()
            if kind == self._FRAME:
                return item
        self.ready.clear()
        return None
