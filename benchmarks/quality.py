"""Greedy replies to fixed prompts, to compare the LLM's weights (4-bit against bf16)
without speech in the loop: how many replies match exactly, how many begin alike, and
whether every reply is non-empty English."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.llm import LlmEngine

PROMPTS = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "What do bees make?",
    "Can you tell me a short joke?",
    "What is the largest ocean on Earth?",
    "How do I boil an egg?",
    "What colour is the sky on a clear day?",
    "Name a big river in Europe.",
    "What is two plus three?",
    "Why do we need sleep?",
    "What should I wear when it rains?",
    "Who wrote Romeo and Juliet?",
)

# The commonest English words: most English sentences hold several, other languages few.
_FUNCTION_WORDS = frozenset(
    [
        "an",
        "the",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "am",
        "it",
        "its",
        "this",
        "that",
        "these",
        "those",
        "i",
        "you",
        "he",
        "she",
        "we",
        "they",
        "me",
        "him",
        "her",
        "us",
        "them",
        "my",
        "your",
        "his",
        "our",
        "their",
        "of",
        "to",
        "in",
        "at",
        "by",
        "for",
        "with",
        "from",
        "as",
        "and",
        "or",
        "but",
        "not",
        "no",
        "so",
        "if",
        "then",
        "than",
        "do",
        "does",
        "did",
        "have",
        "has",
        "had",
        "can",
        "could",
        "will",
        "would",
        "should",
        "may",
        "might",
        "what",
        "which",
        "who",
        "how",
        "why",
        "when",
        "where",
        "there",
        "here",
        "all",
        "some",
        "any",
        "one",
        "two",
        "more",
        "most",
        "very",
        "also",
        "just",
        "about",
        "into",
        "over",
        "up",
        "out",
    ]
)
OPENING_WORDS = 4  # replies "begin alike" when these many first words agree

# What a reply to these prompts must say to be right (any of the words, as a word)
FACTS: dict[str, tuple[str, ...]] = {
    "What is the capital of France?": ("paris",),
    "How many days are there in a week?": ("seven", "7"),
    "What do bees make?": ("honey",),
    "What is the largest ocean on Earth?": ("pacific",),
    "What colour is the sky on a clear day?": ("blue",),
    "What is two plus three?": ("five", "5"),
    "Who wrote Romeo and Juliet?": ("shakespeare",),
}


def looks_english(text: str) -> bool:
    """Latin letters almost only, and an English function word among the first 12 words
    (a reply that then repeats itself is still English; `agreement` tells it apart)."""
    letters = [c for c in text if c.isalpha()]
    words = re.findall(r"[a-z']+", text.lower())[:12]
    if not letters or not words:
        return False
    ascii_share = sum(c.isascii() for c in letters) / len(letters)
    return ascii_share >= 0.95 and any(w in _FUNCTION_WORDS for w in words)


def _opening(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())[:OPENING_WORDS]


async def greedy_replies(engine: LlmEngine, prompts: tuple[str, ...] = PROMPTS) -> list[str]:
    """Each prompt as the first turn of its own conversation, answered greedily."""
    from models.conversation import Conversation

    replies = []
    for prompt in prompts:
        conversation = Conversation(engine)
        try:
            replies.append("".join([delta async for delta in conversation.reply(prompt)]).strip())
        finally:
            conversation.close()
    return replies


@dataclass(frozen=True)
class Agreement:
    prompts: int
    exact: int  # replies identical to the reference's
    same_opening: int  # replies whose first OPENING_WORDS words are the reference's
    non_empty: int
    english: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def agreement(replies: list[str], reference: list[str]) -> Agreement:
    return Agreement(
        prompts=len(replies),
        exact=sum(a == b for a, b in zip(replies, reference, strict=True)),
        same_opening=sum(_opening(a) == _opening(b) for a, b in zip(replies, reference, strict=True)),
        non_empty=sum(bool(r) for r in replies),
        english=sum(looks_english(r) for r in replies),
    )


def facts_kept(replies: list[str], prompts: tuple[str, ...] = PROMPTS) -> int:
    """How many replies to the `FACTS` prompts say the fact."""
    kept = 0
    for prompt, reply in zip(prompts, replies, strict=True):
        words = set(re.findall(r"[a-z0-9]+", reply.lower()))
        kept += prompt in FACTS and bool(words & set(FACTS[prompt]))
    return kept


def is_correct(replies: list[str], reference: list[str]) -> bool:
    """A variant is correct when every reply is non-empty English and it keeps every fact
    the reference keeps (reduced precision may word a reply otherwise, not lose facts)."""
    a = agreement(replies, reference)
    return a.non_empty == a.english == a.prompts and facts_kept(replies) >= facts_kept(reference)
