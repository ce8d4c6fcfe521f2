"""`Reply`: one assistant reply in flight, the owner of the three tasks that make it.

    words (LLM) ─► _generate ─► TtsStream ─► _synthesize ─► Pacer ─► _send ─► Sink.audio
                      │ text, events              │ marks, samples      │ sent (echo gate)
                      ▼                           ▼                     ▼
    Sink.event ◄─ emit (held: kept back)       PlayoutLedger ◄──────────┘

Its lifecycle, every allowed transition in one table (`_ALLOWED`):

    HELD     ─► PLAYING (released) | DROPPED (the caller went on) | DONE (nothing to say)
    PLAYING  ─► PAUSED (the caller's voice over it) | DONE (played out) | CUT
    PAUSED   ─► PLAYING (resumed) | DONE | CUT (barge-in, cancel, truncate, close)

HELD: speculative, begun at a pause in the caller's voice: silent, its events kept back
until it is released (never told if it is not). DONE, CUT and DROPPED are final. The
reply's work is cancelled in one place, `stop`; the transport hears of its end
(`Sink.end_reply`) just before its ``response.done``, in `_deliver`. The session
decides when it ends (`end`) and settles what a stopped reply leaves in the ledger and
the conversation.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from audio_io.ledger import PlayoutLedger, TextMark
from audio_io.pacer import Pacer
from duplex import events as ev
from duplex import metrics
from duplex.echo import EchoGate
from duplex.echo_canceller import EchoCanceller
from duplex.events import Event, SessionError
from duplex.port import Sink
from duplex.state import Lifecycle
from duplex.turn import TurnTimes
from models.conversation import TurnStats
from models.llm import LlmError
from models.llm_types import LlmUnavailable
from models.tts import TtsStream, WordMark

log = logging.getLogger("duplex.reply")


class ReplyState(enum.Enum):
    HELD = "held"
    PLAYING = "playing"
    PAUSED = "paused"
    DONE = "done"
    CUT = "cut"
    DROPPED = "dropped"


_ALLOWED: dict[ReplyState, frozenset[ReplyState]] = {
    ReplyState.HELD: frozenset({ReplyState.PLAYING, ReplyState.DROPPED, ReplyState.DONE}),
    ReplyState.PLAYING: frozenset({ReplyState.PAUSED, ReplyState.DONE, ReplyState.CUT}),
    ReplyState.PAUSED: frozenset({ReplyState.PLAYING, ReplyState.DONE, ReplyState.CUT}),
    ReplyState.DONE: frozenset(),
    ReplyState.CUT: frozenset(),
    ReplyState.DROPPED: frozenset(),
}


@dataclass(frozen=True)
class Outlet:
    """Where a session's replies go, and the books kept of what left."""

    sink: Sink
    ledger: PlayoutLedger  # text, word marks, samples generated, sent (and played)
    echo: EchoGate  # what was sent, to tell the caller from its echo
    canceller: EchoCanceller | None  # ... and to take its echo out of what is heard
    played_when_sent: bool  # no playback reports: audio sent counts as played


class ReplyHost(Protocol):
    """What a reply tells its session; calls must not block."""

    def send_error(self, error: SessionError) -> None: ...

    def began(self, reply: Reply) -> None:
        """The reply's first frame is leaving."""
        ...

    def words_ended(self, reply: Reply) -> None:
        """The LLM's words for the reply ended: all came, or it was stopped or failed."""
        ...

    async def played_out(self, reply: Reply) -> None:
        """Every frame of the reply has left."""
        ...


class Reply:
    def __init__(
        self,
        id: str,
        item_id: str,
        user_text: str,
        times: TurnTimes,
        tts: TtsStream,
        out: Outlet,
        host: ReplyHost,
        held: bool = False,
        session_id: str = "",
        said: str | None = None,
    ) -> None:
        self.id = id
        self.said = said is not None  # the service's own words (`Session.say`), not the model's
        self.session_id = session_id
        self.item_id = item_id
        self.user_text = user_text  # what it answers
        self.times = times
        self.tts = tts
        self.pacer = Pacer()
        self._lifecycle = Lifecycle(f"reply {id}", ReplyState.HELD if held else ReplyState.PLAYING, _ALLOWED)
        self.tasks: list[asyncio.Task[None]] = []
        self.synthesized = False  # TTS has produced every frame
        self.stopped = False  # `stop` was called: none of its tasks runs again
        self.words_ended = False  # the LLM's words ended (all came, or stopped or failed)
        self.error: SessionError | None = None  # it failed (LLM or TTS): it ends ``failed``
        self.quick_paused: float | None = None  # paused on a loud onset, awaiting the VAD's confirmation
        self.announced = not held  # its events go to the client (else they are kept back)
        self.held_events: list[Event] = []
        self._out = out
        self._ledger = out.ledger
        self._host = host
        self._abort: Callable[[], Awaitable[None]] | None = None
        # its latency breakdown and prompt figures, once its first audio left (`report`)
        self._unreported: tuple[dict[str, float], TurnStats] | None = None
        if held:
            self.pacer.pause()

    @property
    def held(self) -> bool:
        return self.state is ReplyState.HELD

    @property
    def state(self) -> ReplyState:
        return self._lifecycle.state

    @property
    def begun(self) -> bool:
        """Its audio has begun to go out (not merely being thought)."""
        return self.times.first_sent is not None

    def to(self, new: ReplyState) -> bool:
        """Move to `new`; True if the state changed. A move the table forbids is a bug."""
        return self._lifecycle.to(new)

    # -- the work --

    def start(self, words: AsyncIterator[str], abort: Callable[[], Awaitable[None]]) -> None:
        """Begin the work: the LLM's ``words`` are spoken (``abort`` stops the LLM)."""
        assert not self.tasks, f"reply {self.id} started twice"
        self._abort = abort
        self.tasks = [
            asyncio.create_task(self._generate(words), name=f"{self.id}-llm"),
            asyncio.create_task(self._synthesize(), name=f"{self.id}-tts"),
            asyncio.create_task(self._send(), name=f"{self.id}-send"),
        ]

    async def stop(self, cut: bool = False) -> None:
        """Cancel the reply's LLM, TTS and send tasks (at once: none of them runs again)
        and wait for them to end. ``cut``: its queued audio and TTS work go first, at
        once (`Pacer.clear` is synchronous: nothing queued leaves after this call)."""
        if cut:
            self.pacer.clear()
            self.tts.cancel()
        self.stopped = True
        for task in self.tasks:
            task.cancel()
        if self._abort is not None:
            await self._abort()
        await gather_cancelled(self.tasks)

    async def _generate(self, words: AsyncIterator[str]) -> None:
        try:
            async for delta in words:
                if self.times.first_token is None:
                    self.times.first_token = time.monotonic()
                self._ledger.turn(self.id).add_text(delta)
                if self.tts.push_text(delta) and self.times.first_phrase is None:
                    self.times.first_phrase = time.monotonic()
                self.emit(ev.TEXT_DELTA, delta=delta)
        except LlmError as e:
            self._fail(llm_failure(e))
        finally:
            if self.tts.end_text() and self.times.first_phrase is None:
                self.times.first_phrase = time.monotonic()
            self.words_ended = True
            self._host.words_ended(self)

    async def _synthesize(self) -> None:
        turn = self._ledger.turn(self.id)
        try:
            async for item in self.tts.frames():
                if isinstance(item, WordMark):
                    mark = TextMark(item.char_start, item.char_end, item.sample_start, item.sample_end)
                    turn.add_mark(mark)
                    continue
                if self.times.first_audio is None:
                    self.times.first_audio = time.monotonic()
                self._ledger.record_generated(self.id, item.num_samples)
                self.pacer.put(item)
        except Exception:  # a phrase that could not be synthesized: what is queued plays, then it ends
            log.exception("reply %s: synthesis failed", self.id)
            self._fail(SessionError("tts_error", "the reply's speech could not be synthesized"))
            self.tts.cancel()
            self.tasks[0].cancel()  # no more words: they would never be heard
            if self._abort is not None:
                await self._abort()
        else:  # every word of the text has its audio (a failed reply's text runs past it),
            # unless a cut ended the stream: then the text runs past the audio too, and
            # a turn counted complete would be heard whole once its audio had played
            if not self.tts.cancelled:
                self._ledger.finish_turn(self.id)
        self.synthesized = True
        if self.pacer.queued_frames == 0:
            self.pacer.close()

    async def _send(self) -> None:
        out = self._out
        async for frame in self.pacer.frames():
            now = time.monotonic()
            if self.times.first_sent is None:
                self.times.first_sent = now
                self._host.began(self)
            position = self._ledger.record_sent(self.id, frame.num_samples)
            if out.played_when_sent:
                self._ledger.record_played(position)
            out.echo.record_sent(frame.samples, frame.sample_rate, now)
            if out.canceller is not None:  # played on the pacer's grid, where the client plays it
                out.canceller.play(frame.samples, frame.sample_rate, frame.playout_time or now)
            out.sink.audio(frame, self.id)
            if self.synthesized and self.pacer.queued_frames == 0:
                break
        if self.synthesized:
            await self._host.played_out(self)

    def _fail(self, error: SessionError) -> None:
        """The reply cannot go on: the client is told at once; it ends ``failed``."""
        if self.error is None:
            self.error = error
            self._host.send_error(error)

    # -- what the client is told, and when --

    def emit(self, type_: str, **data: object) -> None:
        """An event of this reply: kept back until it is released (for good, if it is not)."""
        event = Event(type_, {"response_id": self.id, "item_id": self.item_id, **data})
        if not self.announced:
            self.held_events.append(event)
        else:
            self._deliver(event)

    def release(self) -> None:
        """The turn did end with the words this held reply answers: let it be heard."""
        self.to(ReplyState.PLAYING)
        self.announced = True
        for event in self.held_events:
            self._deliver(event)
        self.held_events.clear()
        self.pacer.resume()

    def _deliver(self, event: Event) -> None:
        if event.type == ev.RESPONSE_DONE:  # the transport sends (or drops) its last frame first
            completed = event.data["status"] == "completed"
            self._out.sink.end_reply(self.id, completed=completed)
        self._out.sink.event(event)

    def pause(self) -> None:
        """Nothing more of it leaves until `resume` (a held reply is silent anyway)."""
        if self.state is ReplyState.PLAYING:
            self.to(ReplyState.PAUSED)
            self.pacer.pause()

    def resume(self) -> None:
        if self.state is ReplyState.PAUSED:
            self.to(ReplyState.PLAYING)
            self.pacer.resume()

    def end(self, status: str | None) -> None:
        """It is over: played out, or stopped (cut; dropped if it was never heard). With
        a ``status``, the client is told (``response.done``; a held reply's is kept back)."""
        if status is not None:
            self.emit(ev.RESPONSE_DONE, status=status)
        if status in ("completed", "failed"):  # it ended by itself, not stopped
            self.to(ReplyState.DONE)
        else:
            self.to(ReplyState.DROPPED if self.held else ReplyState.CUT)

    def report(self, stats: TurnStats | None = None) -> None:
        """Its figures, told once: the latency breakdown as at its first audio (then with
        its prompt's ``stats``), and the prompt's figures once they are the LLM's own (a
        remote LLM says what its cache held with the request's last words; a reply
        stopped before them reports the estimate `TurnStats` kept). The service's own
        words (`said`) have no figures of the model's."""
        if self.said:
            return
        if stats is not None:
            self._unreported = (self.times.breakdown_ms(), stats)
        if self._unreported is None or not (self._unreported[1].settled or self.words_ended):
            return
        breakdown, stats = self._unreported
        self._unreported = None
        tokens: dict[str, float] = {
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
        }
        if self.times.end_of_turn_score is not None:
            tokens["end_of_turn_score"] = round(self.times.end_of_turn_score, 4)
        if stats.result_tokens:
            tokens["result_tokens"] = stats.result_tokens
        metrics.observe_turn(breakdown, stats.prompt_tokens, stats.cached_tokens, stats.result_tokens)
        log.info("session %s: %s began", self.session_id, self.id, extra={"fields": breakdown | tokens})
        self._out.sink.event(Event(ev.METRICS, {"response_id": self.id, **breakdown, **tokens}))

    def said_lately(self, seconds: float) -> str:
        """Its words sent in the last ``seconds``: what its echo would say."""
        turn = self._ledger.turn(self.id)
        earlier = turn.heard_text(max(0, turn.sent - int(seconds * self._ledger.sample_rate)))
        return turn.heard_text(turn.sent)[len(earlier) :]


def llm_failure(e: LlmError) -> SessionError:
    """The typed error a client gets for an LLM request that failed."""
    return SessionError("llm_unavailable" if isinstance(e, LlmUnavailable) else "llm_error", str(e))


async def gather_cancelled(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel tasks (again, if they were) and await them; any other failure is logged, not raised."""
    for task in tasks:
        task.cancel()
    results: list[object] = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            log.error("task failed", exc_info=result)
