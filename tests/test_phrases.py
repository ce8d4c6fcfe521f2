import pytest

from models.phrases import PhraseSplitter

REPLY = (
    "Sure, I can help with that. The weather in Boston tomorrow will be sunny and warm, with a high of "
    "seventy degrees and a light breeze from the west in the afternoon. Anything else?"
)


def split(text: str, step: int, **kwargs) -> list:
    splitter = PhraseSplitter(**kwargs)
    phrases = []
    for i in range(0, len(text), step):
        phrases += splitter.push(text[i : i + step])
    return phrases + splitter.flush()


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_phrases_are_the_same_however_the_text_arrives(step):
    assert [p.text for p in split(REPLY, step)] == [
        "Sure,",
        "I can help with",  # the second phrase: 4 words at most
        "that.",
        "The weather in Boston tomorrow will be sunny and warm,",
        "with a high of seventy degrees and a light breeze from the west in the afternoon.",
        "Anything else?",
    ]


def test_offsets_point_back_into_the_text():
    for phrase in split(REPLY, 5):
        assert REPLY[phrase.char_start : phrase.char_start + len(phrase.text)] == phrase.text
    assert [p.index for p in split(REPLY, 5)] == [0, 1, 2, 3, 4, 5]


def test_first_phrase_is_cut_after_two_words_without_punctuation_and_the_next_grow():
    phrases = split("well I think that we should probably go now", 2)
    assert [p.text for p in phrases] == ["well I", "think that we should", "probably go now"]


def test_a_word_is_never_split_while_it_may_still_grow():
    splitter = PhraseSplitter(first_max_words=2)
    assert splitter.push("Hello wor") == []  # "wor" may become "world"
    assert [p.text for p in splitter.push("ld again ")] == ["Hello world"]


def test_later_phrases_cut_long_runs_without_punctuation():
    words = " ".join(f"w{i}" for i in range(80))
    phrases = split("Okay. " + words, 4)
    assert [len(p.text.split()) for p in phrases] == [1, 4, 8, 16, 24, 24, 4]


def test_empty_and_whitespace_make_no_phrases():
    assert split("", 1) == []
    assert split("   \n ", 1) == []
