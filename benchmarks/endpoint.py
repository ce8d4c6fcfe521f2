"""``duplex bench endpoint``: what each end-of-turn policy costs, to choose the defaults.

A policy ends the caller's turn after ``end_of_turn_ms`` of silence, or after
``complete_turn_ms`` when the LLM judges the words so far a finished turn (its
probability of the end of the user's message there at least ``threshold``), or after
``certain_turn_ms`` when it is nearly sure (at least ``certain_threshold``), or after
``unfinished_turn_ms`` when it judges them unfinished (under ``unfinished_threshold``;
see `duplex.turn_policy.silence_to_end`). Silence alone is the policy with no threshold.

Two turn sets, each turn's audio heard by a real `Listener` (VAD and streaming ASR) and
every pause in it scored by the real LLM, as a session does (the words ASR has at the
pause, `Conversation.end_of_turn`):

- ``pairs``: two sentences of the spoken test set as one caller would say them;
- ``mid_sentence``: a sentence broken off mid-clause by a pause of 300-600 ms
  (hesitations, lists, numbers), synthesized, or the caller's own recordings
  (``--utterances``, each with its pause where it falls).

For each policy and set: ``split_rate``, the turns it would end early, at a pause
inside them (a pause counts if it lasted long enough, however long the LLM took: an
upper bound; but the longer wait after unfinished words counts as if the score were
always in by ``end_of_turn_ms``, as it is at one session: a session with no score yet
ends the turn then); ``silence_waited_ms``, the silence it waits at the turn's real
end. And ``v2v_ms``: voice-to-voice with that policy in one real-time session of
``turns`` questions (echo on), as ``duplex bench conversation``, with its turns' own silence
waited (``session_silence_waited_ms``, which counts the time the ASR and the LLM took).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from audio_io.wav import read_wav
from benchmarks.common import bench_main, new_plot, percentiles, save_plot
from benchmarks.conversation import clips_for, run_sessions, with_engines
from benchmarks.speech_set import SENTENCES
from duplex.config import Config
from duplex.engines import Engines
from duplex.session_config import JUDGED_PAUSE_MS, SessionConfig
from models.conversation import Conversation
from models.listen import Listener, ListenEventKind
from models.tts import voiced_span
from models.vad import VadConfig

CHUNK = RUNTIME_RATE // 50  # fed in 20 ms frames, as a transport would
SCORED_PAUSE_MS = JUDGED_PAUSE_MS  # every pause this long is transcribed and scored, as in a session
MID_SENTENCE = (  # (words before the pause, after it)
    ("I'd like to book a table for", "four people at seven tonight."),
    ("My number is four one five", "two six seven, eight nine."),
    ("I need to buy milk, eggs and", "a loaf of bread."),
    ("Can you tell me", "how far away the moon is?"),
    ("The meeting is on", "Tuesday at three."),
    ("Um, I was wondering if", "you could help me."),
    ("So the thing is", "my car won't start."),
    ("What I really want to know is", "why the sky is blue."),
    ("The code is seven", "three nine two."),
    ("I want to go to", "the train station, please."),
    ("Could you add apples, uh", "bananas and some grapes?"),
    ("Let me think, the date was the", "twenty first of March."),
)
PAUSES_S = (0.3, 0.4, 0.45, 0.6)


@dataclass(frozen=True)
class Policy:
    end_of_turn_ms: int
    complete_turn_ms: int | None = None  # None: silence alone
    threshold: float = 0.0
    unfinished_turn_ms: int | None = None  # None: no longer wait after unfinished words
    unfinished_threshold: float = 0.0
    certain_turn_ms: int | None = None  # None: no shorter wait after surer words
    certain_threshold: float = 1.0

    @property
    def name(self) -> str:
        if self.complete_turn_ms is None:
            return f"silence {self.end_of_turn_ms}"
        name = f"meaning {self.complete_turn_ms}/{self.threshold:g}"
        if self.certain_turn_ms is not None:
            name += f" ({self.certain_turn_ms}/{self.certain_threshold:g})"
        name += f" else {self.end_of_turn_ms}"
        if self.unfinished_turn_ms is not None:
            name += f", under {self.unfinished_threshold:g} {self.unfinished_turn_ms}"
        return name

    def ends(self, silence_ms: float, score: float | None) -> bool:
        """Would a pause this long, after words scored so, end the turn?"""
        return silence_ms >= self.waited_ms(score)

    def waited_ms(self, score: float | None) -> float:
        """The silence it waits at the end of a turn whose words are scored so."""
        return float(self.session_config().silence_to_end(score))

    def session_config(self) -> SessionConfig:
        if self.complete_turn_ms is None:
            return SessionConfig(end_of_turn_ms=self.end_of_turn_ms, end_of_turn_by_meaning=False)
        return SessionConfig(
            end_of_turn_ms=self.end_of_turn_ms,
            complete_turn_ms=self.complete_turn_ms,
            complete_turn_threshold=self.threshold,
            unfinished_turn_ms=self.unfinished_turn_ms or self.end_of_turn_ms,
            unfinished_turn_threshold=self.unfinished_threshold,
            certain_turn_ms=self.certain_turn_ms or self.complete_turn_ms,
            certain_turn_threshold=self.certain_threshold,
        )


_DEFAULTS = SessionConfig()
DEFAULT = Policy(
    _DEFAULTS.end_of_turn_ms,
    _DEFAULTS.complete_turn_ms,
    _DEFAULTS.complete_turn_threshold,
    _DEFAULTS.unfinished_turn_ms,
    _DEFAULTS.unfinished_turn_threshold,
    _DEFAULTS.certain_turn_ms,
    _DEFAULTS.certain_turn_threshold,
)
UNSURE = replace(DEFAULT, certain_turn_ms=None, certain_threshold=1.0)  # the defaults without the surer wait
POLICIES = (
    Policy(300),
    Policy(500),
    Policy(800),
    *(Policy(500, ms, p) for ms in (200, 250, 300, 350) for p in (0.1, 0.2, 0.3, 0.5)),
    Policy(800, 300, 0.2),
    *(Policy(500, 300, 0.3, ms, p) for ms in (700, 800) for p in (0.01, 0.02, 0.05)),
    *(Policy(500, 300, 0.3, 800, 0.02, ms, p) for ms in (200, 250) for p in (0.8, 0.9, 0.95)),
)
assert DEFAULT in POLICIES, "the defaults are among the policies measured"
# silence alone, meaning alone, the defaults without the surer wait, the defaults
TIMED = (Policy(500), Policy(500, 300, 0.3), UNSURE, DEFAULT)


@dataclass(frozen=True)
class Pause:
    silence_ms: float  # how long it lasted (the turn's last: as long as the audio)
    score: float | None  # the LLM's P(the turn is over) after the words heard by then
    words: str
    inside: bool  # before the turn's last voiced sample: ending the turn here splits it


async def pauses_of(engines: Engines, turn: npt.NDArray[np.int16]) -> list[Pause]:
    """Every pause of at least `SCORED_PAUSE_MS` in a turn, as a session would judge it."""
    listener = Listener(engines.vad, engines.asr, VadConfig(min_silence_ms=10_000, pause_ms=SCORED_PAUSE_MS))
    conversation = Conversation(engines.llm)
    _, last_voiced = voiced_span(turn.astype(np.float32), RUNTIME_RATE)
    audio = np.concatenate([turn, np.zeros(RUNTIME_RATE, np.int16)])  # and a second of silence
    found: list[tuple[int, float | None, str]] = []  # (pause start, score, words)
    ended: dict[int, int] = {}  # pause start -> where speech resumed
    try:
        for start in range(0, audio.size, CHUNK):
            before = listener.vad.pause
            for event in await listener.push(audio[start : start + CHUNK]):
                if event.kind is ListenEventKind.PAUSED and listener.vad.pause is not None:
                    words = await listener.asr.speculative() or ""
                    score = await conversation.end_of_turn(words) if words.strip() else None
                    found.append((listener.vad.pause, score, words))
            if before is not None and listener.vad.pause is None:
                ended[before] = listener.position
            await listener.asr.idle()
    finally:
        listener.close()
        conversation.close()
    return [
        Pause(
            (ended.get(at, audio.size) - at) * 1000 / RUNTIME_RATE,
            score,
            words,
            at < last_voiced,
        )
        for at, score, words in found
    ]


def judge(policy: Policy, turns: list[list[Pause]]) -> dict[str, Any]:
    splits = [any(p.inside and policy.ends(p.silence_ms, p.score) for p in turn) for turn in turns]
    finals = [next((p for p in reversed(turn) if not p.inside), None) for turn in turns]
    waited = [policy.waited_ms(p.score) for p in finals if p is not None]
    return {
        "split_rate": round(sum(splits) / len(turns), 3),
        "splits": sum(splits),
        "silence_waited_ms": percentiles(waited),
    }


def mid_sentence_turns(engines: Engines, recordings: list[str] | None) -> list[npt.NDArray[np.int16]]:
    if recordings:
        out = []
        for path in recordings:
            samples, rate = read_wav(path)
            out.append(resample(samples, rate, RUNTIME_RATE))
        return out
    tts = engines.tts

    def say(text: str) -> npt.NDArray[np.int16]:
        """The words alone: the voice's own silence before and after is cut, so that the
        pause between the two parts is the one given."""
        audio = resample(tts.synthesize(text).audio, tts.sample_rate, RUNTIME_RATE)
        first, last = voiced_span(audio.astype(np.float32), RUNTIME_RATE)
        return audio[first:last]

    return [
        np.concatenate([say(a), np.zeros(int(PAUSES_S[i % len(PAUSES_S)] * RUNTIME_RATE), np.int16), say(b)])
        for i, (a, b) in enumerate(MID_SENTENCE)
    ]


def bench_endpoint(config: Config, turns: int = 10, recordings: list[str] | None = None) -> dict[str, Any]:
    async def body(engines: Engines) -> dict[str, Any]:
        tts = engines.tts
        pairs = [f"{SENTENCES[i]} {SENTENCES[(i + 1) % len(SENTENCES)]}" for i in range(len(SENTENCES))]
        sets = {
            "pairs": [resample(tts.synthesize(t).audio, tts.sample_rate, RUNTIME_RATE) for t in pairs],
            "mid_sentence": mid_sentence_turns(engines, recordings),
        }
        heard = {name: [await pauses_of(engines, turn) for turn in audio] for name, audio in sets.items()}
        clips, lines = clips_for(engines)
        policies: dict[str, Any] = {}
        for policy in POLICIES:
            row: dict[str, Any] = {name: judge(policy, turns_) for name, turns_ in heard.items()}
            if turns and policy in TIMED:
                run = await run_sessions(engines, clips, lines, 1, turns, policy.session_config())
                row["v2v_ms"] = run["v2v_ms"]
                row["session_silence_waited_ms"] = run["end_of_turn"]["silence_waited_ms"]
                row["self_interruptions"] = run["self_interruptions"]
            policies[policy.name] = row
        return {
            "policies": policies,
            "turns": {name: len(audio) for name, audio in sets.items()},
            "pauses": {
                name: [
                    [
                        {
                            "silence_ms": round(p.silence_ms),
                            "score": p.score,
                            "words": p.words,
                            "inside": p.inside,
                        }
                        for p in turn
                    ]
                    for turn in turns_
                ]
                for name, turns_ in heard.items()
            },
            "mid_sentence_source": "recordings" if recordings else "synthesized",
        }

    return with_engines(
        config,
        body,
        "split_rate: turns a policy would end at a pause inside them (every pause of "
        f"{SCORED_PAUSE_MS} ms or more transcribed and scored by the LLM, as a session does); "
        "silence_waited_ms: at the turns' real end; "
        "v2v_ms: one real-time session of questions with echo at -20 dB",
    )


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_endpoint(config, turns=args.turns or 10, recordings=args.utterances)


def plot(result: dict[str, Any]) -> None:
    """Split rate against the silence waited, per policy, on the mid-sentence turns."""
    fig, ax = new_plot()
    for name, row in result["policies"].items():
        x = row["mid_sentence"]["silence_waited_ms"]["p50"]
        y = row["mid_sentence"]["split_rate"] * 100
        ax.plot([x], [y], "o" if name.startswith("meaning") else "s", label=name)
    save_plot(
        fig,
        ax,
        "endpoint",
        "End-of-turn policies, turns with mid-sentence pauses (CPU, 2 cores)",
        "turns split, %",
        xlabel="silence waited at the end of the turn, p50 (ms)",
    )


if __name__ == "__main__":
    bench_main("endpoint", measure, plot)
