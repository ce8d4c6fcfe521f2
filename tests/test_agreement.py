from models.agreement import HypWord, LocalAgreement


def words(text: str, end_of_last: int = 0, step: int = 1000) -> list[HypWord]:
    out = []
    for i, w in enumerate(text.split()):
        out.append(HypWord(" " + w, (i,), i * step, (i + 1) * step))
    return out


def test_words_commit_when_two_passes_agree_and_have_settled():
    agreement = LocalAgreement(settle=1500)
    assert agreement.update(words("I would like"), audio_end=4000) == []  # nothing to agree with yet
    new = agreement.update(words("I would like to book"), audio_end=6000)
    # "I would like" agree; "like" ends at 3000 <= 6000 - 1500
    assert [w.text for w in new] == [" I", " would", " like"]
    new = agreement.update(words("I would like to book a"), audio_end=6400)
    # "to" (ends 4000) settled; "book" ends 5000 > 6400 - 1500: not yet
    assert [w.text for w in new] == [" to"]


def test_agreement_ignores_case_and_punctuation():
    agreement = LocalAgreement(settle=0)
    agreement.update(words("hello there."), 9000)
    assert [w.text for w in agreement.update(words("Hello, there again"), 9000)] == [" Hello,", " there"]


def test_disagreement_stops_the_commit_at_the_first_difference():
    agreement = LocalAgreement(settle=0)
    agreement.update(words("book a tape now"), 9000)
    assert [w.text for w in agreement.update(words("book a table now"), 9000)] == [" book", " a"]


def test_a_committed_word_merged_with_the_next_tokens_commits_nothing_and_breaks_nothing():
    # the tokens of "I am 3" are forced; the next pass decodes "0" after them, and the
    # word split reads "30": the hypothesis no longer starts with the committed words
    agreement = LocalAgreement(settle=0)
    agreement.update(words("I am 3"), 9000)
    assert [w.text for w in agreement.update(words("I am 3 years"), 9000)] == [" I", " am", " 3"]
    assert agreement.update(words("I am 30 years old"), 9000) == []
    assert [w.text for w in agreement.committed] == [" I", " am", " 3"]
    # a later pass that splits the forced tokens as committed goes on committing
    assert [w.text for w in agreement.update(words("I am 3 years old"), 9000)] == []
    assert [w.text for w in agreement.update(words("I am 3 years old"), 9000)] == [" years", " old"]
