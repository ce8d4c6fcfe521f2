"""The ASR's types: what its callers get, and what its parts hand each other.

A caller gets `AsrResult`s made of `AsrWord`s, or `AsrClosed` from an engine that is
stopping. Inside, the pass queue (`models.asr_queue`) hands the Whisper runner
(`models.asr_runner`) a `Window` to transcribe and gets a `Hypothesis` back; the
stream (`models.asr_stream`) turns hypotheses into results.

A module of their own so that whoever needs only a type (the session's turn-taking, the
pass queue and its tests) imports neither the runner nor the model libraries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from audio_io.pcm import RUNTIME_RATE
from models.agreement import HypWord

SAMPLE_RATE = RUNTIME_RATE  # every position below counts samples of the 16 kHz stream
PREVIOUS_TEXT_TOKENS = 48  # context from before the window, as Whisper's previous-text prompt


class AsrClosed(RuntimeError):
    """A pass asked of, or left unfinished by, a closed engine (the server is stopping)."""


@dataclass(frozen=True)
class AsrWord:
    text: str
    start: int  # stream sample positions (16 kHz)
    end: int


@dataclass(frozen=True)
class AsrResult:
    text: str  # the whole utterance as heard so far (final: as heard)
    committed: tuple[AsrWord, ...]  # words that will not change
    final: bool
    audio_end: int  # stream position of the last sample this pass saw
    compute_ms: float


@dataclass(frozen=True)
class Window:
    """What one pass transcribes: audio from stream position ``offset``, continuing the
    committed ``prefix`` tokens, with ``previous`` text from before the window."""

    audio: npt.NDArray[np.float32]
    offset: int
    prefix: list[int]
    previous: list[int]
    draft: list[int] = field(default_factory=list)  # tokens the text may go on with (the last pass's)


@dataclass(frozen=True)
class Hypothesis:
    """What one pass heard: its words (with stream positions once timed), text and tokens."""

    words: list[HypWord]
    text: str
    tokens: list[int] = field(default_factory=list)
    offset: int = 0
    encoded: npt.NDArray[np.float32] | None = None  # the audio's encoder states, for word times
    frames: int = 0
