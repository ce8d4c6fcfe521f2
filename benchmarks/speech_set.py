"""A small, varied spoken test set, synthesized by our own TTS, and word error rate.

Used by the tests and by ``duplex bench asr``: 20 sentences of the kinds a voice agent
hears (questions, requests, short answers, names, a long sentence), rendered
deterministically (no generator noise) by the bundled voice and resampled to 16 kHz.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from audio_io.resample import resample

SENTENCES = (
    "Could you tell me what the weather will be like tomorrow in Boston?",
    "I would like to book a table for two at the Italian place downtown.",
    "Yes, that sounds good to me.",
    "No, thanks.",
    "What time does the pharmacy on Main Street close tonight?",
    "Please remind me to call my sister when I get home.",
    "How long does it take to drive from Chicago to Denver?",
    "Can you read me the last message from Sarah?",
    "Turn off the lights in the kitchen and lock the front door.",
    "I think I left my umbrella at the office yesterday afternoon.",
    "What is the difference between a crocodile and an alligator?",
    "Okay, let's do that.",
    "My flight was cancelled and I need to find another one as soon as possible.",
    "Tell me a short story about a dragon who loves to bake bread.",
    "Where is the nearest gas station?",
    "Hello, is anybody there?",
    "I'm not sure I understood what you just said, could you repeat it more slowly?",
    "Add milk, eggs and a loaf of bread to my shopping list.",
    "Who wrote the novel Pride and Prejudice?",
    "Thank you very much, that was really helpful.",
)

_PUNCT = re.compile(r"[^\w\s']")


def normalize(text: str) -> list[str]:
    return _PUNCT.sub(" ", text.lower()).split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(edit distance in words, reference length)."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[len(hyp)], len(ref)


def wer(pairs: list[tuple[str, str]]) -> float:
    """Corpus WER over (reference, hypothesis) pairs."""
    errors = sum(word_errors(r, h)[0] for r, h in pairs)
    words = sum(word_errors(r, h)[1] for r, h in pairs)
    return errors / max(words, 1)


@dataclass(frozen=True)
class Utterance:
    text: str
    audio: npt.NDArray[np.int16]  # 16 kHz
    voiced: tuple[int, int]  # first and last voiced sample (by energy)


def synthesize_set(tts: object, sentences: tuple[str, ...] = SENTENCES) -> list[Utterance]:
    """Every sentence through the TTS engine (a `models.tts.TtsEngine`), at 16 kHz."""
    from models.tts import TtsEngine, voiced_span

    assert isinstance(tts, TtsEngine)
    out = []
    for text in sentences:
        audio = resample(tts.synthesize(text).audio, tts.sample_rate, 16000)
        out.append(Utterance(text, audio, voiced_span(audio.astype(np.float32), 16000)))
    return out
