"""What a session knows of one turn: its timings, the reply in flight, an interruption
being judged, and which words are backchannels. Plain data; the decisions are in
`duplex.session`."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from audio_io.pacer import Pacer
from duplex.events import Event
from models.tts import TtsStream

BACKCHANNELS = frozenset(
    ("uh-huh", "uh", "huh", "mm-hmm", "mm", "hmm", "mhm", "hm", "okay", "ok", "yeah", "yes", "yep")
    + ("right", "sure", "alright", "aha", "ah", "oh", "um", "i", "see")
    + ("thank", "thanks", "you")  # also what Whisper makes of a short hum ("You", "Thank you.")
)
_WORD = re.compile(r"[a-z]+(?:-[a-z]+)*")


def is_backchannel(text: str) -> bool:
    """True for an utterance of backchannel words only (or none), or of one word said
    over and over ("Then, then, then, then"), which is Whisper looping on a hum."""
    words = _WORD.findall(text.lower())
    if len(words) >= 3 and len(set(words)) == 1:
        return True
    return all(word in BACKCHANNELS for word in words)


def is_echo_of(heard: str, spoken: str, share: float = 0.6) -> bool:
    """True when the words heard are mostly the assistant's own recent words, in order
    (their longest common subsequence is at least ``share`` of them): its echo, come
    back loud enough to pass for the caller (a phone line at -10 dB)."""
    words, said = _WORD.findall(heard.lower()), _WORD.findall(spoken.lower())
    if not words or not said:
        return False
    row = [0] * (len(said) + 1)  # LCS by dynamic programming, one row at a time
    for word in words:
        diagonal = 0
        for j, other in enumerate(said, 1):
            diagonal, row[j] = row[j], diagonal + 1 if word == other else max(row[j], row[j - 1])
    return row[-1] >= share * len(words)


@dataclass
class TurnTimes:
    """Monotonic times of one turn's steps, for its latency breakdown."""

    speech_end: float | None = None  # when the caller's last voiced sample arrived
    stopped: float | None = None  # the VAD declared the end of the turn
    final: float | None = None  # ASR's final text
    first_token: float | None = None
    first_phrase: float | None = None  # the first phrase's text is complete
    first_audio: float | None = None  # TTS produced the first frame
    first_sent: float | None = None  # the first frame left the server

    def breakdown_ms(self) -> dict[str, float]:
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000, 1)

        steps = {
            "endpoint_ms": ms(self.speech_end, self.stopped),
            "asr_final_ms": ms(self.stopped, self.final),
            "llm_first_token_ms": ms(self.final, self.first_token),
            "first_phrase_ms": ms(self.first_token, self.first_phrase),
            "tts_first_audio_ms": ms(self.first_phrase, self.first_audio),
            "send_ms": ms(self.first_audio, self.first_sent),
            "voice_to_voice_ms": ms(self.speech_end, self.first_sent),
        }
        return {k: v for k, v in steps.items() if v is not None}


@dataclass
class Response:
    """One assistant reply in flight: its text, its audio, and the tasks making them."""

    id: str
    item_id: str
    tts: TtsStream
    pacer: Pacer
    times: TurnTimes
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    synthesized: bool = False  # TTS has produced every frame
    user_text: str = ""
    held: bool = False  # speculative: begun at a pause, silent and unannounced until confirmed
    held_events: list[Event] = field(default_factory=list)
    quick_paused: float | None = None  # paused on a loud onset, awaiting the VAD's confirmation


@dataclass
class Interruption:
    """Caller speech over the reply, not yet judged a barge-in or a false alarm."""

    position: int  # 16 kHz stream position where the caller's voice began
    words: str = ""
    stopped: int | None = None  # where the VAD heard it end, if it did before it was judged
