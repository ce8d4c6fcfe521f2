"""`SessionConfig`: a session's settings, checked when made; the bad ones are a
`SessionError` for the client that sent them (``bad_audio_format``, ``bad_config``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from audio_io.pcm import RUNTIME_RATE
from duplex import turn_policy as policy
from duplex.events import SessionError

if TYPE_CHECKING:
    from models.vad import VadConfig

MAX_SYSTEM_PROMPT = 8000  # characters
MAX_SAID_CHARS = 200  # the service's own words (a filler, an apology)
# A pause this long starts the judgement of the caller's turn: the final pass, the LLM's
# score and the held reply. One VAD window, the soonest the VAD can tell, so that the
# reply is ready by `certain_turn_ms`; pauses this short inside an utterance are rare
# (figures: docs/performance.md, "The judgement at one VAD window")
JUDGED_PAUSE_MS = 32


def check_system_prompt(prompt: object) -> str | None:
    """A system prompt (or instructions) as a client sent it: None, or a string of at
    most `MAX_SYSTEM_PROMPT` characters; anything else is a ``bad_config`` error."""
    if prompt is None:
        return None
    if not isinstance(prompt, str) or len(prompt) > MAX_SYSTEM_PROMPT:
        raise SessionError(
            "bad_config", f"system_prompt must be a string of at most {MAX_SYSTEM_PROMPT} chars"
        )
    return prompt


@dataclass(frozen=True)
class SessionConfig:
    input_rate: int = RUNTIME_RATE
    input_channels: int = 1
    system_prompt: str | None = None
    end_of_turn_ms: int = 500  # silence that ends the caller's turn (duplex bench endpoint)
    # ... or this much, after words the LLM judges a finished turn (`turn_policy.silence_to_end`;
    # all chosen with duplex bench endpoint: shorter splits more two-sentence turns, and
    # the reply is not ready sooner on 2 cores)
    complete_turn_ms: int = 300
    complete_turn_threshold: float = 0.3  # the LLM's probability that the user's message ends there
    # ... or this much, after words it is nearly sure end the turn (duplex bench endpoint:
    # no pause inside a turn of its sets scored this high)
    certain_turn_ms: int = 250
    certain_turn_threshold: float = 0.9
    # ... or this much, after words it judges unfinished ("so the thing is,": a probability
    # under the threshold, where the pauses silence alone splits score and real ends of
    # statements seldom do; figures: docs/performance.md, "Unfinished words wait longer")
    unfinished_turn_ms: int = 800
    unfinished_turn_threshold: float = 0.02
    end_of_turn_by_meaning: bool = True  # false: silence alone (end_of_turn_ms) ends the turn
    resume_false_interruptions: bool = True  # speech over the reply with no words resumes it
    echo_suppression_db: float = 12.0
    # the reply's echo taken out before the gate judges (`EchoCanceller`), so a soft vowel,
    # nasal or glide under the echo's level cuts the reply where it begins, for a little
    # voice-to-voice and CPU (figures: docs/performance.md, "A moved echo path is not the
    # caller"); false for a line that cancels its own echo, or to save that CPU
    echo_cancellation: bool = True
    speculative_replies: bool = True  # begin the reply, silently, at a pause in the caller's voice
    barge_in_min_speech_ms: int = 64  # while the reply plays, speech starts sooner (96 otherwise)
    max_inbound_s: float = 10.0  # audio waiting to be heard; more is dropped, with an error
    playback_acks: bool = False  # the transport reports playback; else sent counts as played
    # pause the reply on a frame louder than its echo could be, before the VAD decides:
    # off by default until it is shown not to pause replies on their own echo; with it,
    # soft onsets stop far sooner (figures: docs/performance.md, "Duplex runtime")
    quick_pause: bool = False
    word_times: bool = False  # final transcripts carry word times (an alignment pass more per turn)
    answer_turns: bool = True  # each finished user turn is answered; false: held for `respond`
    barge_in: bool = True  # the caller's speech cuts the reply; false: it is the next turn
    vad_threshold: float = 0.5  # speech probability that counts as speech
    speech_prefix_ms: int = 30  # audio before the detected start that belongs to the utterance
    # while the client's functions run (`duplex.tool_wait`): a filler when no result has
    # come this long after the reply that made the calls (0: none), and an apology when
    # none has come in this long (the call is then answered with an error result)
    tool_filler_ms: int = 800
    tool_filler_text: str = "One moment."
    tool_timeout_s: float = 15.0
    tool_timeout_text: str = "Sorry, I could not get an answer."

    # settings a client may change while the session runs (`Session.configure`)
    RUNTIME_KEYS: ClassVar[tuple[str, ...]] = (
        "end_of_turn_ms",
        "complete_turn_ms",
        "complete_turn_threshold",
        "certain_turn_ms",
        "certain_turn_threshold",
        "unfinished_turn_ms",
        "unfinished_turn_threshold",
        "end_of_turn_by_meaning",
        "resume_false_interruptions",
        "speculative_replies",
        "barge_in_min_speech_ms",
        "echo_suppression_db",
        "word_times",
        "answer_turns",
        "barge_in",
        "vad_threshold",
        "speech_prefix_ms",
        "tool_filler_ms",
        "tool_filler_text",
        "tool_timeout_s",
        "tool_timeout_text",
    )

    def __post_init__(self) -> None:
        if self.input_rate not in (8000, 16000, 24000, 32000, 44100, 48000):
            raise SessionError("bad_audio_format", f"unsupported input rate {self.input_rate} Hz")
        if self.input_channels not in (1, 2):
            raise SessionError("bad_audio_format", f"unsupported channel count {self.input_channels}")
        check_system_prompt(self.system_prompt)
        for key, low, high in (
            ("end_of_turn_ms", 200, 5000),
            ("complete_turn_ms", 100, 5000),
            ("certain_turn_ms", 100, 5000),
            ("unfinished_turn_ms", 200, 5000),
            ("barge_in_min_speech_ms", 20, 1000),
            ("speech_prefix_ms", 0, 2000),
            ("tool_filler_ms", 0, 10000),
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise SessionError("bad_config", f"{key} must be a whole number from {low} to {high}")
        if not isinstance(self.echo_suppression_db, int | float) or not 0 <= self.echo_suppression_db <= 40:
            raise SessionError("bad_config", "echo_suppression_db must be a number from 0 to 40")
        timeout = self.tool_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0.5 <= timeout <= 600:
            raise SessionError("bad_config", "tool_timeout_s must be a number from 0.5 to 600")
        for key in ("tool_filler_text", "tool_timeout_text"):
            if not isinstance(getattr(self, key), str) or len(getattr(self, key)) > MAX_SAID_CHARS:
                raise SessionError("bad_config", f"{key} must be a string of at most {MAX_SAID_CHARS} chars")
        threshold = self.vad_threshold
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not 0.2 <= threshold <= 0.95
        ):
            raise SessionError("bad_config", "vad_threshold must be a number from 0.2 to 0.95")
        for key in ("complete_turn_threshold", "certain_turn_threshold", "unfinished_turn_threshold"):
            score = getattr(self, key)
            if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
                raise SessionError("bad_config", f"{key} must be a number from 0 to 1")
        for key in (
            "resume_false_interruptions",
            "end_of_turn_by_meaning",
            "speculative_replies",
            "playback_acks",
            "quick_pause",
            "echo_cancellation",
            "word_times",
            "answer_turns",
            "barge_in",
        ):
            if not isinstance(getattr(self, key), bool):
                raise SessionError("bad_config", f"{key} must be true or false")

    def changed(self, changes: dict[str, object]) -> SessionConfig:
        """These settings changed while the session runs (only `RUNTIME_KEYS`); a bad key
        or value is a `SessionError`."""
        unknown = sorted(set(changes) - set(self.RUNTIME_KEYS))
        if unknown:
            raise SessionError("bad_config", f"cannot change {unknown} (can: {list(self.RUNTIME_KEYS)})")
        return replace(self, **changes)  # type: ignore[arg-type]

    def silence_to_end(self, score: float | None) -> int:
        """The silence that ends the caller's turn after words the LLM gave ``score``
        (None: not judged), by these settings (`turn_policy.silence_to_end`)."""
        if not self.end_of_turn_by_meaning:
            return self.end_of_turn_ms
        return policy.silence_to_end(
            score,
            self.end_of_turn_ms,
            self.finished_turn_rules,
            self.unfinished_turn_ms,
            self.unfinished_turn_threshold,
        )

    @property
    def finished_turn_rules(self) -> tuple[tuple[float, int], ...]:
        """(threshold, ms): words the LLM scores at least a threshold end the turn after
        its silence (`turn_policy.silence_to_end`)."""
        return (
            (self.complete_turn_threshold, self.complete_turn_ms),
            (self.certain_turn_threshold, self.certain_turn_ms),
        )

    def vad(self, base: VadConfig) -> VadConfig:
        """The VAD's settings for this session, on top of ``base``."""
        # the pause that starts the turn's final pass, its score and the held reply:
        # sooner when meaning may end the turn (the reply must be ready by then)
        pause_ms = min(base.pause_ms, JUDGED_PAUSE_MS) if self.end_of_turn_by_meaning else base.pause_ms
        # the VAD ends the utterance after end_of_turn_ms; the session ends it sooner
        # after finished words and has the VAD wait longer after unfinished ones, as the
        # rules say (`silence_to_end`)
        return replace(
            base,
            min_silence_ms=self.end_of_turn_ms,
            pause_ms=min(pause_ms, *(ms for _, ms in self.finished_turn_rules), self.end_of_turn_ms),
            threshold=self.vad_threshold,
            prefix_pad_ms=self.speech_prefix_ms,
        )
