"""`PlayoutLedger`: what of each assistant turn was generated, sent and played.

Pure bookkeeping (integers and strings, no I/O, no clocks). Positions are in samples
of the session's output rate.

Each turn counts its own samples from 0. The samples a session *sends* form one
stream across turns (silence between turns is not counted), and transports report
playback on that stream (a gRPC ``PlaybackAck`` of N samples, a Twilio ``mark`` echo):

    stream:   |--- turn a (sent 300) ---|--- turn b (sent 500) ---|
    position: 0                        300                       800
    played 450  ->  turn a fully played, turn b played 150

Text marks tie spans of the turn's text to spans of its audio (from TTS word timings
or estimates). A word counts as heard once ``heard_fraction`` of its audio was played
(default one half), so "the text the caller heard up to position P" is one bisect.

The ledger keeps the latest `MAX_TURNS` turns: a session that runs for hours holds
bounded books, and a turn that old was played out long ago.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MAX_TURNS = 64


@dataclass(frozen=True, slots=True)
class TextMark:
    """Characters ``[char_start, char_end)`` of the turn text are spoken in samples
    ``[sample_start, sample_end)`` of the turn audio."""

    char_start: int
    char_end: int
    sample_start: int
    sample_end: int


@dataclass(slots=True)
class TurnPlayout:
    turn_id: str
    heard_fraction: float = 0.5
    text: str = ""
    generated: int = 0  # samples produced by TTS
    sent: int = 0  # samples that left the server
    played: int = 0  # samples the caller's device played (as reported)
    stream_start: int | None = None  # stream position of the turn's first sent sample
    complete: bool = False  # TTS has generated audio for all of ``text``
    marks: list[TextMark] = field(default_factory=list)
    _thresholds: list[int] = field(default_factory=list)  # per mark: samples to count as heard

    def add_text(self, text: str) -> tuple[int, int]:
        """Append generated text; returns its ``[start, end)`` character span."""
        start = len(self.text)
        self.text += text
        return start, len(self.text)

    def add_mark(self, mark: TextMark) -> None:
        last = self.marks[-1] if self.marks else None
        assert 0 <= mark.char_start <= mark.char_end <= len(self.text), (
            f"mark {mark} is outside the turn text of {len(self.text)} chars: add_text before add_mark"
        )
        assert mark.sample_start <= mark.sample_end, f"mark {mark} ends before it starts"
        assert last is None or (mark.char_start >= last.char_end and mark.sample_start >= last.sample_end), (
            f"mark {mark} overlaps or precedes {last}: marks must be added in order"
        )
        self.marks.append(mark)
        span = mark.sample_end - mark.sample_start
        # ceil(start + fraction * span), with a zero-length mark heard at its start
        self._thresholds.append(mark.sample_start + max(0, -int(-self.heard_fraction * span // 1)))

    def heard_marks(self, played: int | None = None) -> int:
        """How many marks count as heard at ``played`` samples (default: as reported)."""
        p = self.played if played is None else played
        return bisect.bisect_right(self._thresholds, p)

    def heard_text(self, played: int | None = None) -> str:
        """The text the caller heard when ``played`` samples of this turn had played.

        Text between the last heard mark and the next one (spaces, punctuation) is
        included only once the next mark is heard, or, for the tail after the last
        mark, once the turn is complete and every generated sample has played.
        """
        p = self.played if played is None else played
        n = self.heard_marks(p)
        if self.complete and n == len(self.marks) and p >= self.generated:
            return self.text
        return self.text[: self.marks[n - 1].char_end] if n else ""


class PlayoutLedger:
    """All assistant turns of one session, and the shared stream of sent samples."""

    def __init__(self, sample_rate: int, heard_fraction: float = 0.5) -> None:
        if not 0.0 <= heard_fraction <= 1.0:
            raise ValueError("heard_fraction must be within [0, 1]")
        self.sample_rate = sample_rate
        self.heard_fraction = heard_fraction
        self.turns: dict[str, TurnPlayout] = {}
        self._order: list[str] = []  # turns in the order they first sent audio
        self.stream_sent = 0
        self.stream_played = 0

    def start_turn(self, turn_id: str) -> TurnPlayout:
        assert turn_id not in self.turns, f"turn {turn_id!r} started twice"
        turn = TurnPlayout(turn_id, self.heard_fraction)
        self.turns[turn_id] = turn
        while len(self.turns) > MAX_TURNS:
            oldest = next(iter(self.turns))  # the first started
            del self.turns[oldest]
            if oldest in self._order:
                self._order.remove(oldest)
        return turn

    def turn(self, turn_id: str) -> TurnPlayout:
        return self.turns[turn_id]

    def record_generated(self, turn_id: str, samples: int) -> None:
        self.turns[turn_id].generated += samples

    def record_sent(self, turn_id: str, samples: int) -> int:
        """Count samples leaving the server; returns the stream position after them.

        Only the latest turn may send: a turn's samples are contiguous in the stream.
        """
        turn = self.turns[turn_id]
        if turn.stream_start is None:
            turn.stream_start = self.stream_sent
            self._order.append(turn_id)
        assert self._order[-1] == turn_id, f"turn {turn_id!r} sent audio after {self._order[-1]!r} started"
        assert turn.sent + samples <= turn.generated, f"turn {turn_id!r} sent more than it generated"
        turn.sent += samples
        self.stream_sent += samples
        return self.stream_sent

    def record_played(self, stream_position: int) -> None:
        """The caller has played the stream up to ``stream_position`` samples.

        Reports are clamped to what was sent (clients race and round) and never move
        backwards.
        """
        before = self.stream_played
        position = max(before, min(stream_position, self.stream_sent))
        self.stream_played = position
        for turn_id in reversed(self._order):
            turn = self.turns[turn_id]
            assert turn.stream_start is not None
            if turn.stream_start + turn.sent <= before:
                break  # wholly played by an earlier report, and so is every earlier turn
            turn.played = max(turn.played, min(turn.sent, position - turn.stream_start))

    def truncate(self, turn_id: str, samples: int) -> int:
        """The client says only ``samples`` of this turn were played (a Realtime
        ``conversation.item.truncate``): unlike a playback report, this may move the
        turn's played position back. Clamped to what was sent; returns the samples kept."""
        turn = self.turns[turn_id]
        turn.played = max(0, min(samples, turn.sent))
        return turn.played

    def record_played_in_turn(self, turn_id: str, samples: int) -> None:
        """The caller has played ``samples`` of this turn (e.g. from a transport that
        knows its own playout position per turn); clamped to what was sent."""
        turn = self.turns[turn_id]
        if turn.stream_start is not None:  # everything sent before it has played too
            self.record_played(turn.stream_start + min(samples, turn.sent))

    def finish_turn(self, turn_id: str) -> None:
        """TTS has generated audio for all of the turn's text."""
        self.turns[turn_id].complete = True

    def discard_unsent(self, turn_id: str) -> int:
        """After a flush: forget generated audio that never left; returns its length."""
        turn = self.turns[turn_id]
        dropped = turn.generated - turn.sent
        turn.generated = turn.sent
        turn.complete = turn.complete and dropped == 0
        return dropped

    def heard_text(self, turn_id: str, played: int | None = None) -> str:
        return self.turns[turn_id].heard_text(played)

    def audio_end_ms(self, turn_id: str) -> int:
        """Milliseconds of this turn the caller heard (for ``conversation.item.truncated``)."""
        return self.turns[turn_id].played * 1000 // self.sample_rate
