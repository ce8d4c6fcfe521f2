"""Committing ASR words while the caller speaks: local agreement between hypotheses.

Each partial hypothesis of an utterance is a list of words. A word is committed when
two consecutive hypotheses agree on it and on everything before it, and its audio
ended at least ``settle`` samples before the end of the audio transcribed (a word
still being spoken may change). Committed words are then forced as the decoder's
prefix for every later pass, so no later hypothesis can retract them.

Pure bookkeeping: words in, committed words out; no model, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NORMALIZE = re.compile(r"[^\w']+")


@dataclass(frozen=True)
class HypWord:
    text: str  # as the tokenizer spells it, leading space included
    tokens: tuple[int, ...]
    start: int  # stream sample positions
    end: int


def word_key(word: HypWord) -> str:
    """What two hypotheses must agree on: the word without case or punctuation."""
    return _NORMALIZE.sub("", word.text.lower())


@dataclass
class LocalAgreement:
    settle: int = 8000  # samples (0.5 s at 16 kHz)
    committed: list[HypWord] = field(default_factory=list)
    _previous: list[HypWord] = field(default_factory=list)

    def update(self, hypothesis: list[HypWord], audio_end: int) -> list[HypWord]:
        """Feed a hypothesis continuing the committed words' tokens; returns new commits.

        The committed tokens are forced, but the words of the hypothesis are split anew:
        the last committed word can merge with what follows ("3" then "0" is the word
        "30"). Such a hypothesis commits nothing, and the next one has nothing to agree
        with; the one after may commit again.
        """
        n = len(self.committed)
        if [word_key(w) for w in hypothesis[:n]] != [word_key(w) for w in self.committed]:
            self._previous = []  # nothing for the next pass to agree with
            return []
        new: list[HypWord] = []
        for i in range(n, min(len(hypothesis), len(self._previous))):
            word = hypothesis[i]
            if (
                word_key(word) != word_key(self._previous[i])
                or not word_key(word)
                or word.end > audio_end - self.settle
            ):
                break
            new.append(word)
        self.committed.extend(new)
        self._previous = hypothesis
        return new

    def previous_keys(self) -> list[str]:
        return [word_key(w) for w in self._previous]

    def draft(self) -> list[int]:
        """The last hypothesis's tokens after the committed words: what the next pass
        will likely say again (a guess its decoder checks, `WhisperDecoder.generate`)."""
        return [t for w in self._previous[len(self.committed) :] for t in w.tokens]
