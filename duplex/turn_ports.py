"""What turn-taking (`duplex.turn_taking.TurnTaking`) sees and does, as four narrow
protocols: the inbound audio it reads (`Ears`, the `Inbound`), the VAD and ASR it asks
(`Hearing`, the `Listener`), the reply in progress it watches (`ReplyView`, the `Reply`)
and the session it acts on (`TurnHost`, the `Session`, which makes every change of
state). Scripted doubles of the first three and a recording host run the whole room
with no model (tests/test_turn_taking.py).
"""

from __future__ import annotations

from typing import Protocol

from audio_io.frame import Int16Array
from duplex.events import SessionError
from duplex.reply import ReplyState
from duplex.session_config import SessionConfig
from duplex.turn import TurnTimes, UnansweredTurns
from models.listen import ListenEvent


class Ears(Protocol):
    """What turn-taking reads of the inbound audio (`duplex.inbound.Inbound`)."""

    async def next(self, position: int) -> tuple[Int16Array, Int16Array, float]: ...

    def arrival(self, position: int) -> float: ...

    def echoing(self, at: float) -> bool: ...

    def level(self, samples: Int16Array) -> tuple[float, float]: ...

    def may_be_echo(self, since: float, now: float) -> bool: ...

    def first_above_echo(self, start: int) -> int | None: ...


class Hearing(Protocol):
    """What turn-taking asks of the VAD and the ASR (`models.listen.Listener`)."""

    speaking: bool
    ignoring: bool
    preroll: int

    @property
    def position(self) -> int: ...

    @property
    def pause(self) -> int | None: ...

    @property
    def paused(self) -> bool: ...

    @property
    def silence_ms(self) -> float: ...

    @property
    def min_silence_ms(self) -> int: ...

    async def push(self, samples: Int16Array) -> list[ListenEvent]: ...

    async def end_turn(self) -> list[ListenEvent]: ...

    def restart(self, position: int) -> None: ...

    def ignore(self) -> None: ...

    def hold_pause(self, pause: int, silence_ms: int) -> None: ...

    async def speculative(self) -> str | None: ...


class ReplyView(Protocol):
    """What turn-taking sees of the reply in progress (`duplex.reply.Reply`)."""

    id: str
    user_text: str  # what it answers
    stopped: bool
    quick_paused: float | None  # paused on a loud frame, awaiting the VAD's confirmation
    times: TurnTimes

    @property
    def state(self) -> ReplyState: ...

    @property
    def held(self) -> bool: ...

    @property
    def begun(self) -> bool:
        """Its audio has begun to go out."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def said_lately(self, seconds: float) -> str: ...


class TurnHost(Protocol):
    """What turn-taking does to its session (`duplex.session.Session`): each call makes
    the session's state change, if any."""

    id: str
    config: SessionConfig

    @property
    def unanswered(self) -> UnansweredTurns: ...

    @property
    def reply(self) -> ReplyView | None:
        """The reply in progress: held, playing or paused."""
        ...

    def begin_user_turn(self, position: int) -> str:
        """A user turn begins (its item id)."""
        ...

    def interrupt(self, reply: ReplyView) -> None:
        """Speech over the reply may cut it: it pauses, and its queued audio goes."""
        ...

    async def answer(self, text: str, times: TurnTimes) -> None: ...

    def hold(self, text: str, times: TurnTimes) -> None:
        """Begin the reply to ``text``, silently, to be released or dropped."""
        ...

    def release(self, reply: ReplyView) -> None: ...

    async def stop_reply(self) -> None: ...

    async def cut(self, reply: ReplyView) -> None: ...

    async def drop(self, reply: ReplyView) -> None: ...

    def resume(self) -> None:
        """The interruption was not one: the reply goes on (listen, if it has ended)."""
        ...

    def settle(self) -> None:
        """A user turn ended with nothing to answer now."""
        ...

    def emit(self, type_: str, **data: object) -> None: ...

    def send_error(self, error: SessionError) -> None: ...

    async def prefill(self, words: str) -> None:
        """Feed the caller's words so far to the LLM (`Conversation.prefill`)."""
        ...

    async def turn_score(self, words: str) -> float | None:
        """P(the user's turn is over after these words), None if the LLM cannot say."""
        ...
