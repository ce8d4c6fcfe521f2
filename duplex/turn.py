"""What a session knows of its user turns: one turn's timings, an interruption being
judged, the turns not answered yet. Plain data; the decisions are in
`duplex.turn_policy`, acting on them in `duplex.turn_taking`, the reply in `duplex.reply`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from audio_io.pcm import RUNTIME_RATE
from duplex.events import SessionError
from models.asr_types import AsrWord
from models.conversation import MAX_USER_CHARS


@dataclass
class TurnTimes:
    """Monotonic times of one turn's steps, for its latency breakdown."""

    speech_end: float | None = None  # when the caller's last voiced sample arrived
    stopped: float | None = None  # the VAD declared the end of the turn
    final: float | None = None  # ASR's final text
    scored: float | None = None  # the LLM judged how likely the turn is over after it
    first_token: float | None = None
    first_phrase: float | None = None  # the first phrase's text is complete
    first_audio: float | None = None  # TTS produced the first frame
    first_sent: float | None = None  # the first frame left the server
    silence_ms: float | None = None  # the pause that ended the turn had lasted this long
    end_of_turn_score: float | None = None  # the LLM's P(the turn is over) at that pause
    call: float | None = None  # the reply wrote its first call of a client's function (whole)
    result: float | None = None  # the last of the tool results it answers came

    def breakdown_ms(self) -> dict[str, float]:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000, 1)

        steps = {
            "silence_waited_ms": None if self.silence_ms is None else round(self.silence_ms, 1),
            "endpoint_ms": ms(self.speech_end, self.stopped),
            "asr_final_ms": ms(self.stopped, self.final),
            "end_of_turn_score_ms": ms(self.final, self.scored),
            "llm_first_token_ms": ms(self.final, self.first_token),
            "first_phrase_ms": ms(self.first_token, self.first_phrase),
            "tts_first_audio_ms": ms(self.first_phrase, self.first_audio),
            "send_ms": ms(self.first_audio, self.first_sent),
            "voice_to_voice_ms": ms(self.speech_end, self.first_sent),
            "tool_call_ms": ms(self.final, self.call),  # the end of the turn to its call
            "tool_result_to_audio_ms": ms(self.result, self.first_sent),
        }
        return {k: v for k, v in steps.items() if v is not None}


@dataclass
class Interruption:
    """Caller speech over the reply, not yet judged a barge-in or a false alarm."""

    position: int  # 16 kHz stream position where the caller's voice began
    words: str = ""
    stopped: int | None = None  # where the VAD heard it end, if it did before it was judged


def word_times_ms(words: Iterable[AsrWord]) -> list[dict[str, object]]:
    """Words of a transcript with their times in the input stream, in milliseconds."""
    ms = 1000 / RUNTIME_RATE
    return [{"text": w.text, "start_ms": round(w.start * ms), "end_ms": round(w.end * ms)} for w in words]


class UnansweredTurns:
    """User turns not answered yet: given by the client (`Session.add_turn`), or heard
    while ``answer_turns`` is off or over a reply the caller may not cut. They are
    answered together, as one turn, so together they hold at most what one turn may
    (``limit`` characters, a newline between two)."""

    def __init__(self, limit: int = MAX_USER_CHARS) -> None:
        self.limit = limit
        self._turns: list[str] = []
        self.after_reply = False  # answer them once the reply playing ends

    def __iter__(self) -> Iterator[str]:
        return iter(self._turns)

    def __len__(self) -> int:
        return len(self._turns)

    def _size(self) -> int:
        return sum(len(t) + 1 for t in self._turns)

    def add(self, text: str) -> None:
        """A turn the client gave; one that does not fit is a `SessionError`."""
        if self._size() + len(text) > self.limit:
            raise SessionError(
                "too_much_input",
                f"{self._size()} characters of user turns wait for a reply; one takes {self.limit} at most",
            )
        self._turns.append(text)

    def keep(self, text: str, after_reply: bool = False) -> None:
        """A turn heard: the oldest go to make room for it (the newest always stays)."""
        self._turns.append(text)
        while self._size() > self.limit and len(self._turns) > 1:
            self._turns.pop(0)
        self.after_reply = self.after_reply or after_reply

    def remove(self, text: str | None) -> None:
        """The client deleted one (no error if it is not here)."""
        if text in self._turns:
            self._turns.remove(text)

    def with_(self, words: str) -> str:
        """These turns and ``words`` after them, as the LLM gets them."""
        return "\n".join([*self._turns, words])

    def take(self, words: str) -> str:
        """The one turn to answer now: these and ``words``; none waits after it."""
        text = self.with_(words).strip()
        self._turns.clear()
        self.after_reply = False
        return text
