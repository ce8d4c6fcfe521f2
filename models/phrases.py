"""Cutting a stream of LLM text deltas into phrases for a sentence-level TTS.

Piper synthesizes a whole phrase in one pass, so the first phrase of a reply decides
when the caller first hears anything: it is cut as early as a clause boundary or two
words allow (a 2-word first phrase is ready, and heard, well before a 4-word one).
Each later phrase must be decoded and synthesized while the earlier ones play, so
phrases grow: at most 2, 4, 8, 16, then 24 words, cut sooner at sentence ends and long
clauses for better prosody. They double, no faster: sentence-long phrases straight
after a short first one, or growth by three, leave gaps in replies (figures:
docs/performance.md, "Duplex runtime").

Offsets are character positions in the accumulated text of the turn, so that word
marks can point back into the text the LLM produced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*\s")
_CLAUSE_END = re.compile(r"[,;:—–]\s|\s[-–—]\s")
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Phrase:
    text: str  # stripped
    char_start: int  # offset of text[0] in the turn's text
    index: int  # 0 for the first phrase of the turn


@dataclass
class PhraseSplitter:
    first_max_words: int = 2  # first phrase: cut at this many words if no clause ends sooner
    growth: int = 2  # each phrase may be this many times longer than the one before
    later_clause_words: int = 8  # later phrases: a clause boundary cuts once this long
    later_max_words: int = 24  # no phrase is longer (at a word boundary)

    def __post_init__(self) -> None:
        self.text = ""
        self._cut = 0  # text[:_cut] has been emitted
        self._count = 0

    def push(self, delta: str) -> list[Phrase]:
        self.text += delta
        phrases = []
        while (phrase := self._next(final=False)) is not None:
            phrases.append(phrase)
        return phrases

    def flush(self) -> list[Phrase]:
        """End of the text: whatever is left is the last phrase."""
        phrase = self._next(final=True)
        return [phrase] if phrase else []

    def _emit(self, end: int) -> Phrase | None:
        raw = self.text[self._cut : end]
        self._cut = end
        stripped = raw.strip()
        if not stripped:
            return None
        phrase = Phrase(stripped, end - len(raw) + (len(raw) - len(raw.lstrip())), self._count)
        self._count += 1
        return phrase

    def _next(self, final: bool) -> Phrase | None:
        pending = self.text[self._cut :]
        if final:
            return self._emit(len(self.text))
        first = self._count == 0
        sentence = _SENTENCE_END.search(pending)
        clause = _CLAUSE_END.search(pending)
        words = list(_WORD.finditer(pending))
        # only words followed by whitespace are complete
        complete = [w for w in words if w.end() < len(pending)]
        cut: int | None = None
        if sentence:
            cut = sentence.end()
        if clause and (cut is None or clause.end() < cut):
            clause_words = len(_WORD.findall(pending[: clause.end()]))
            if first or clause_words >= self.later_clause_words:
                cut = clause.end()
        limit = min(self.first_max_words * self.growth ** min(self._count, 8), self.later_max_words)
        if len(complete) >= limit:
            at = complete[limit - 1].end()
            if cut is None or at < cut:
                cut = at
        if cut is None:
            return None
        phrase = self._emit(self._cut + cut)
        return phrase if phrase else self._next(final=False)
