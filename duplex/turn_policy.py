"""Turn-taking decisions as pure functions: inputs in (words, levels, times, settings),
a verdict out. No session, no models, no clock (times are passed in), so each is tested
in milliseconds on a table of cases (tests/test_turn_policy.py); `duplex.turn_taking`
gathers the inputs and acts on the verdicts (through the session).

The rules. The end of the caller's turn is a pause whose length depends on how finished
the LLM judges the words before it (`silence_to_end`): short after a finished turn
(``complete_turn_ms``), shorter after one it is nearly sure of (``certain_turn_ms``),
long after an unfinished one (``unfinished_turn_ms``), else ``end_of_turn_ms``, the
VAD's silence. Words whose judgement could not come before that
silence runs out (`judgement_in_time`) are not judged: the reply need not wait for it.
Speech that starts while the assistant talks is first checked against the echo of what
was sent (`EchoGate`): echo is ignored, utterance and all. Otherwise
the reply is paused at once and the interruption is *tentative* (sooner still: a frame
louder than the reply's echo and the room could be pauses the reply ~100 ms before the
VAD decides; if the VAD hears no caller within `QUICK_PAUSE_CONFIRM_S`, the reply goes
on). A word other than a backchannel ("uh-huh", "okay", "right") makes it a barge-in:
the reply is cut to the words the caller heard and the utterance is the next turn. An
utterance that ends without such a word (a cough, a "mm-hmm") resumes the reply where
it paused (false-interruption resume); one that is the reply's own words, come back
loud, resumes it too.

    loud frame ─► quick_pause ────────► LOUD: paused, unless the echo gate says echo
    VAD: speech ─► speech_over_reply ─┬─ ECHO: ignored (judged again as it goes on)
                                      ├─ TURN: a new user turn (no reply it may cut)
                                      └─ INTERRUPTION: paused, the sink flushed; then
    its words  ─► judge_interruption ─┬─ WAIT: not yet (backchannel words so far)
                                      ├─ RESUME: a backchannel, or no words at all
                                      ├─ ECHO: the reply's own words come back
                                      └─ BARGE_IN: the reply is cut, the words are a turn
    its end    ─► finished_turn ──────── ANSWER | AFTER_REPLY | HOLD | ECHO | NONE
"""

from __future__ import annotations

import enum
import re

QUICK_PAUSE_FLOOR_DB = -50.0  # a quieter frame never pauses the reply before the VAD decides
QUICK_PAUSE_OVER_ROOM_DB = 15.0  # ... nor one less this much above the quietest of the last 2 s
QUICK_PAUSE_CONFIRM_S = 0.25  # the VAD must confirm the caller's voice this soon, or the reply goes on
QUICK_PAUSE_HOLDOFF_S = 1.0  # after a false alarm, only the VAD pauses the reply for this long
# an utterance still going on is judged the reply's echo by this many words at least: one
# or two common words ("the", "of") are in most replies, and the caller's words, heard
# from a little before their voice rose over the echo, may begin with one of its words
ECHO_MIN_WORDS = 3

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


class QuickPause(enum.Enum):
    NONE = "none"  # nothing to do
    LOUD = "loud"  # louder than the room could be: pause the reply, unless it may be its echo
    FALSE_ALARM = "false_alarm"  # the VAD did not confirm the last quick pause: resume, hold off


def quick_pause(
    level_db: float,
    quietest_db: float,
    paused_at: float | None,
    paused: bool,
    holdoff_until: float,
    now: float,
) -> QuickPause:
    """A frame arrived while the reply plays: a frame louder than the room could be is
    most likely the caller starting to speak, ~100 ms before the VAD can tell.

    ``level_db``: the frame's; ``quietest_db``: the quietest of the last 2 s (the room);
    ``paused_at``: when the reply was quick-paused and not yet confirmed (else None);
    ``paused``: the reply is paused anyway; ``holdoff_until``: no quick pause before."""
    if paused_at is not None:
        return QuickPause.FALSE_ALARM if now - paused_at > QUICK_PAUSE_CONFIRM_S else QuickPause.NONE
    if paused or now < holdoff_until:
        return QuickPause.NONE
    if level_db < max(quietest_db + QUICK_PAUSE_OVER_ROOM_DB, QUICK_PAUSE_FLOOR_DB):
        return QuickPause.NONE
    return QuickPause.LOUD


class Over(enum.Enum):
    """What speech heard while the assistant talks (or its echo fades) is."""

    ECHO = "echo"  # nothing in it is louder than the reply's echo could be: ignored for now
    TURN = "turn"  # the caller, with no reply playing or one they may not cut: a new turn
    INTERRUPTION = "interruption"  # the caller, over a reply they may cut: pause it, judge the words


def speech_over_reply(caller_heard: bool, reply_playing: bool, barge_in: bool) -> Over:
    """``caller_heard``: part of the speech is louder than echo could be (`EchoGate`)."""
    if not caller_heard:
        return Over.ECHO
    if not reply_playing or not barge_in:
        return Over.TURN
    return Over.INTERRUPTION


class Verdict(enum.Enum):
    """An interruption's words, judged."""

    WAIT = "wait"  # backchannel words so far, or too few to tell: the reply stays paused until more are heard
    RESUME = "resume"  # a backchannel, or no words at all: the reply goes on where it paused
    ECHO = "echo"  # the reply's own words, come back loud: it goes on, the utterance is ignored
    BARGE_IN = "barge_in"  # the caller's words: the reply is cut, the utterance is the next turn


def judge_interruption(
    words: str, reply_said: str | None, ended: bool, resume_without_words: bool = True
) -> Verdict:
    """``words``: heard so far (committed by ASR), or all of them once the utterance has
    ``ended``; ``reply_said``: the reply's last words sent (None if it has ended);
    ``resume_without_words``: an utterance that ends with no words resumes the reply
    (``SessionConfig.resume_false_interruptions``), else it cuts it."""
    if is_backchannel(words):
        if not ended:
            return Verdict.WAIT
        if words or resume_without_words:
            return Verdict.RESUME
    if reply_said is not None and is_echo_of(words, reply_said):
        return Verdict.ECHO if ended or len(_WORD.findall(words)) >= ECHO_MIN_WORDS else Verdict.WAIT
    return Verdict.BARGE_IN


class Turn(enum.Enum):
    """What becomes of a user turn's final words (once any interruption was judged)."""

    NONE = "none"  # no words
    ECHO = "echo"  # the words are the reply's own, heard over it: no turn
    ANSWER = "answer"  # answered now
    AFTER_REPLY = "after_reply"  # heard over a reply the caller may not cut: answered when it ends
    HOLD = "hold"  # kept until the client asks for a reply (``answer_turns`` off)


def finished_turn(text: str, over_reply_said: str | None, answer_turns: bool) -> Turn:
    """``over_reply_said``: the last words sent of the reply this turn was heard over,
    when the caller may not cut it (``barge_in`` off); else None."""
    if not text:
        return Turn.NONE
    if over_reply_said is not None and is_echo_of(text, over_reply_said):
        return Turn.ECHO
    if not answer_turns:
        return Turn.HOLD
    return Turn.AFTER_REPLY if over_reply_said is not None else Turn.ANSWER


def silence_to_end(
    score: float | None,
    end_ms: int,
    finished: tuple[tuple[float, int], ...],
    unfinished_ms: int,
    unfinished_threshold: float,
) -> int:
    """The caller is in a pause after words the LLM has judged (``score``: the
    probability it gives the end of the user's message right after them; None: not
    known, or not to be used): how long a silence ends their turn. ``finished``:
    (threshold, ms) pairs: words scored at least a threshold end the turn after its ms,
    never more than others (the shortest of the pairs they pass: a surer end, a shorter
    wait); an unfinished one (under ``unfinished_threshold``: "what I really want to
    know is,") waits ``unfinished_ms``, never less than others; other words, and words
    not judged, ``end_ms``."""
    if score is None:
        return end_ms
    passed = [ms for threshold, ms in finished if score >= threshold]
    if passed:
        return min(*passed, end_ms)
    if score < unfinished_threshold:
        return max(unfinished_ms, end_ms)
    return end_ms


JUDGING_WEIGHT = 0.3  # how much of each new measurement a session's figure takes (`judging_ms`)
JUDGING_DECAY = 0.25  # how much a pause not judged lowers it


def judgement_in_time(silence_ms: float, judging_ms: float, end_ms: int) -> bool:
    """The caller has been silent ``silence_ms`` when their words are ready to judge; the
    LLM's judgements of late took ``judging_ms``. Could this one come before the silence
    ends the turn anyway (``end_ms``)? Only then can it change when the turn ends."""
    return silence_ms + judging_ms < end_ms


def judging_ms(figure_ms: float, measured_ms: float | None, end_ms: int) -> float:
    """A session's figure for how long the LLM's judgement takes, after one more
    (an exponentially weighted mean; the first measurement is taken whole). One that
    took longer than the whole silence ``end_ms`` counts as that long. ``measured_ms``
    None: the pause was not judged (`judgement_in_time`), and the figure is lowered by
    `JUDGING_DECAY`, so that one slow judgement (the machine was busy) does not keep the
    next ones from being asked."""
    if measured_ms is None:
        return figure_ms * (1 - JUDGING_DECAY)
    measured_ms = min(measured_ms, end_ms)
    if figure_ms <= 0:
        return measured_ms
    return figure_ms + JUDGING_WEIGHT * (measured_ms - figure_ms)


def should_speculate(
    speculative_replies: bool, answer_turns: bool, interrupting: bool, reply_in_progress: bool
) -> bool:
    """The caller paused: begin the reply to their words so far, silently?"""
    return speculative_replies and answer_turns and not interrupting and not reply_in_progress


def in_pause(paused: bool, pause: int | None, judged_at: int | None) -> bool:
    """Do words or a judgement taken at the pause that began at ``judged_at`` still hold?
    Only while the caller is in that same pause (``paused``: the VAD has announced the
    pause it is in, which began at ``pause``): a caller who spoke on began another."""
    return paused and judged_at is not None and pause == judged_at


def turn_over(needed_ms: int, vad_silence_ms: int, silence_ms: float, judging_echo: bool) -> bool:
    """The caller has been silent ``silence_ms`` in a pause after judged words, which end
    the turn after ``needed_ms`` (`silence_to_end`): is the turn over, sooner than the
    VAD's own silence (``vad_silence_ms``) would end it? Never while speech over the reply
    (an interruption, or its echo) is being judged (``judging_echo``): that waits for the VAD."""
    return not judging_echo and needed_ms < vad_silence_ms and silence_ms >= needed_ms


def restart_at(caller_start: int, utterance_start: int, ignoring: bool, preroll: int) -> int | None:
    """The caller's voice rose over the echo (from ``caller_start``, its preroll included)
    in an utterance the VAD began at ``utterance_start``: where its transcription must
    begin again, or None if it already begins in the right place. An utterance that began
    with echo begins again where the caller does; one whose start was the caller's but was
    taken for echo, and not transcribed (``ignoring``), begins again at its own start,
    with the listener's ``preroll``."""
    if caller_start > utterance_start:
        return caller_start
    if ignoring:
        return utterance_start - preroll
    return None
