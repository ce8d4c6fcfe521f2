"""PlayoutLedger: exact lookups at hand-computed positions (16 kHz, 1 ms = 16 samples)."""

import pytest

from audio_io.ledger import PlayoutLedger, TextMark


def ledger_with_hello_world() -> PlayoutLedger:
    """Turn "t1": "Hello world. Bye" with three word marks.

    text:    Hello world. Bye
    chars:   0-5   6-12   13-16
    samples: 1600-4800  6400-9600  11200-12800  (generated: 14400)
    heard at 50%: 3200, 8000, 12000
    """
    ledger = PlayoutLedger(16000)
    turn = ledger.start_turn("t1")
    turn.add_text("Hello world. Bye")
    turn.add_mark(TextMark(0, 5, 1600, 4800))
    turn.add_mark(TextMark(6, 12, 6400, 9600))
    turn.add_mark(TextMark(13, 16, 11200, 12800))
    ledger.record_generated("t1", 14400)
    return ledger


@pytest.mark.parametrize(
    ("played", "heard"),
    [
        (0, ""),  # nothing played
        (1599, ""),  # before the first mark
        (3199, ""),  # inside "Hello", less than half
        (3200, "Hello"),  # exactly half of "Hello"
        (4800, "Hello"),  # end of "Hello", in the gap
        (7999, "Hello"),  # inside "world.", under half
        (8000, "Hello world."),
        (11999, "Hello world."),
        (12000, "Hello world. Bye"),
        (99999, "Hello world. Bye"),  # after the end
    ],
)
def test_heard_text_at_hand_computed_positions(played, heard):
    assert ledger_with_hello_world().heard_text("t1", played) == heard


def test_tail_after_the_last_mark_needs_a_complete_turn_played_to_the_end():
    ledger = PlayoutLedger(16000)
    turn = ledger.start_turn("t")
    turn.add_text("Yes!")
    turn.add_mark(TextMark(0, 3, 0, 1000))
    ledger.record_generated("t", 2000)
    assert turn.heard_text(2000) == "Yes"  # TTS has not finished the turn
    ledger.finish_turn("t")
    assert turn.heard_text(1999) == "Yes"
    assert turn.heard_text(2000) == "Yes!"


def test_stream_positions_map_acks_onto_turns():
    ledger = ledger_with_hello_world()
    assert ledger.record_sent("t1", 9000) == 9000
    ledger.record_played(8000)
    assert ledger.turn("t1").played == 8000
    assert ledger.heard_text("t1") == "Hello world."
    assert ledger.audio_end_ms("t1") == 500
    ledger.record_played(50_000)  # clients race: clamped to what was sent
    assert ledger.turn("t1").played == 9000
    ledger.record_played(100)  # and never moves backwards
    assert ledger.stream_played == 9000


def test_acks_spanning_two_turns_update_both():
    ledger = PlayoutLedger(8000)
    for name, n in (("a", 300), ("b", 500)):
        ledger.start_turn(name)
        ledger.record_generated(name, n)
        ledger.record_sent(name, n)
    ledger.record_played(450)
    assert (ledger.turn("a").played, ledger.turn("b").played) == (300, 150)
    ledger.record_played(800)
    assert (ledger.turn("a").played, ledger.turn("b").played) == (300, 500)
    assert ledger.turn("b").stream_start == 300


def test_a_jump_over_several_turns_still_updates_the_earlier_ones():
    ledger = PlayoutLedger(8000)
    for name in "abc":
        ledger.start_turn(name)
        ledger.record_generated(name, 100)
        ledger.record_sent(name, 100)
    ledger.record_played(300)
    assert [ledger.turn(n).played for n in "abc"] == [100, 100, 100]


def test_flush_discards_unsent_audio_and_the_turn_is_no_longer_complete():
    ledger = ledger_with_hello_world()
    ledger.finish_turn("t1")
    ledger.record_sent("t1", 5000)
    assert ledger.discard_unsent("t1") == 9400
    turn = ledger.turn("t1")
    assert (turn.generated, turn.complete) == (5000, False)
    ledger.record_played(5000)
    assert ledger.heard_text("t1") == "Hello"


def test_per_turn_playout_reports():
    ledger = ledger_with_hello_world()
    ledger.record_sent("t1", 10000)
    ledger.record_played_in_turn("t1", 8100)
    assert ledger.heard_text("t1") == "Hello world."
    assert ledger.stream_played == 8100


def test_broken_invariants_name_the_bug():
    ledger = ledger_with_hello_world()
    turn = ledger.turn("t1")
    with pytest.raises(AssertionError, match="in order"):
        turn.add_mark(TextMark(0, 5, 0, 100))
    with pytest.raises(AssertionError, match="outside the turn text"):
        turn.add_mark(TextMark(16, 40, 13000, 14000))
    with pytest.raises(AssertionError, match="more than it generated"):
        ledger.record_sent("t1", 20000)
    ledger.start_turn("t2")
    ledger.record_generated("t2", 10)
    ledger.record_sent("t2", 10)
    with pytest.raises(AssertionError, match="after"):
        ledger.record_sent("t1", 1)
    with pytest.raises(AssertionError, match="twice"):
        ledger.start_turn("t2")


def test_an_empty_send_does_not_hide_earlier_turns():
    ledger = PlayoutLedger(16000)
    ledger.start_turn("a")
    ledger.record_generated("a", 300)
    ledger.record_sent("a", 300)
    ledger.start_turn("b")
    ledger.record_sent("b", 0)  # e.g. a resampler that has not produced output yet
    ledger.record_played(300)
    assert ledger.turn("a").played == 300


def test_a_per_turn_report_counts_earlier_turns_as_played():
    ledger = PlayoutLedger(16000)
    for name, n in (("a", 300), ("b", 200)):
        ledger.start_turn(name)
        ledger.record_generated(name, n)
        ledger.record_sent(name, n)
    ledger.record_played_in_turn("b", 200)
    ledger.record_played(500)
    assert (ledger.turn("a").played, ledger.turn("b").played) == (300, 200)


def test_a_long_session_keeps_only_its_latest_turns():
    from audio_io.ledger import MAX_TURNS

    ledger = PlayoutLedger(16000)
    for i in range(MAX_TURNS * 3):
        turn = ledger.start_turn(f"t{i}")
        turn.add_text("Hi.")
        ledger.record_generated(f"t{i}", 320)
        ledger.record_sent(f"t{i}", 320)
        ledger.record_played(ledger.stream_sent)
    assert len(ledger.turns) == MAX_TURNS and len(ledger._order) == MAX_TURNS
    assert f"t{MAX_TURNS * 3 - 1}" in ledger.turns and "t0" not in ledger.turns
    assert ledger.turns[f"t{MAX_TURNS * 3 - 1}"].played == 320  # the latest turns keep their books
