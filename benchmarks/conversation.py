"""``duplex bench conversation``: scripted conversations through whole sessions, in real time.

Each session is a `VirtualCaller` whose microphone also picks up the assistant's voice
at -20 dB, 40-250 ms late, through a small room (RT60 0.15 s): a speakerphone without
echo cancellation (the service's own is on unless ``--session-config`` turns it off). Its script:

    ask A ─ reply ─ { ask for a story ─ interrupt after 1.0-1.6 s of it ─ reply } ─ ask C ─ reply

with the braces once for each interrupting line (`benchmarks.interruptions`: every kind
of onset, in the bundled voice and in real people's), each session from another one.

- ``v2v_ms``: the end of the caller's voice to the first reply frame reaching the caller.
- ``bargein_stop_ms``: the onset of the interrupting voice to the last frame of the cut
  reply; also by the line's onset kind and voice, and ``interruptions_missed``: lines
  that a reply played on over for half a second or more without being cut
  (``interruptions_unplayed``: the other lines that cut nothing: said when no reply was
  playing, or as one ended by itself, as a short reply to the story request does).
- ``truncation_exact_rate``: cut replies whose truncated text, in the event and in the
  conversation, equals what the caller heard by its own count (half of a word played);
  ``inexact_samples`` names the others (what was heard, what was kept).
- ``audio_gaps``: silences of over 100 ms inside a reply that no caller voice paused
  (its audio ran out: TTS fell behind).
- ``self_interruptions``: pauses of a reply (to be cut, resumed, or a quick pause the VAD
  did not confirm) with no caller audio in the half second before them or at the time:
  the reply's echo taken for the caller.
- ``loop_lag_p99_ms``: how late a 10 ms timer on the event loop fires, 99th percentile.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import psutil

from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from audio_io.wav import read_wav
from benchmarks.caller import Silence, Speak, Step, UntilHeard, UntilReplyDone, VirtualCaller, heard_by_marks
from benchmarks.common import bench_main, new_plot, percentiles, save_plot, sessions_of
from benchmarks.interruptions import Line, interrupting_lines
from duplex import events as ev
from duplex.config import Config
from duplex.engines import Engines
from duplex.events import SessionError
from duplex.metrics import LoopLag
from duplex.session import Session
from duplex.session_config import SessionConfig
from models.cpu_variant import cpu_description

QUESTIONS = ("What is the capital city of France?", "Name a big river in Europe.", "What do bees make?")
STORY = "Please tell me a long story about a brave little dragon."
ECHO_DB = -20.0
PLAYED_ON_S = 0.5  # a reply that played on this long after a line's onset missed it
CALLER_REACH_S = 0.5  # a pause of the reply this soon after the caller's audio may be theirs


def _script(clips: dict[str, Speak], lines: list[Line], i: int, turns: int) -> tuple[list[Step], list[str]]:
    """A session's timeline, and the label of each clip it speaks, in order."""
    steps: list[Step] = [Silence(0.3 + 0.45 * i)]  # staggered starts
    spoken: list[str] = []

    def say(label: str, then: Step) -> None:
        steps.extend([clips[label], then])
        spoken.append(label)

    if turns:  # a long session: question after question
        for t in range(turns):
            say(QUESTIONS[t % len(QUESTIONS)], UntilReplyDone(timeout=60, after=0.6))
        return steps, spoken
    say(QUESTIONS[0], UntilReplyDone(timeout=60, after=0.6))
    for j in range(len(lines)):
        say(STORY, UntilHeard(1.0 + 0.2 * ((i + j) % 4), timeout=60))
        say(lines[(i + j) % len(lines)].label, UntilReplyDone(timeout=60, after=0.6))
    say(QUESTIONS[1 + i % 2], UntilReplyDone(timeout=60, after=0.6))
    return steps, spoken


async def _session(
    engines: Engines, clips: dict[str, Speak], lines: list[Line], i: int, turns: int, config: SessionConfig
) -> dict[str, Any]:
    caller = VirtualCaller(echo_db=ECHO_DB, echo_delay_s=0.04 + 0.21 * (i % 5) / 4, echo_room=True)
    session = Session(engines, caller, config)
    steps, spoken = _script(clips, lines, i, turns)
    by_label = {line.label: line for line in lines}
    stopped: set[int] = set()  # the utterances that stopped a reply
    bargein: list[dict[str, Any]] = []
    await session.start()
    try:
        await caller.play(session, steps)
    finally:
        await session.close()
    said = [k for k, label in enumerate(spoken) if label in by_label]  # the interrupting lines
    v2v, stops, exact, cuts, inexact = [], [], 0, 0, []
    created = caller.of_type(ev.RESPONSE_CREATED)
    samples = []
    for k, answer, heard_at, voice_end in replies_to_utterances(caller):
        v2v.append((heard_at - voice_end) * 1000)
        samples.append({"session": i, "utterance": k, "response_id": answer, "v2v_ms": round(v2v[-1], 1)})
    for done in caller.of_type(ev.RESPONSE_DONE):
        cut = [e for e in caller.of_type(ev.TRUNCATED) if e.data["item_id"] == done.data["item_id"]]
        if done.data["status"] != "cancelled" or not cut:
            continue  # played out, or cancelled by the end of the session
        truncated = cut[0]
        cuts += 1
        rid = str(done.data["response_id"])
        first, last = caller.first_frame(rid), caller.last_frame(rid)
        # the line that stopped it: the last whose sound began before its audio stopped
        # coming (not before its response.done: a line judged by its words is cut a second
        # after its onset, by when the reply had long stopped and the next line may have
        # begun); the stop counts from its voice's onset
        stop = last if last is not None else done.at
        k = max(k for k, (s, _) in enumerate(caller.sound_spans) if s < stop)
        onset, line = caller.voice_spans[k][0], by_label.get(spoken[k])
        if first is not None and last is not None and onset > first and line:  # it was playing: stopped
            stops.append((line, max(0.0, last - onset) * 1000))
            stopped.add(k)
            bargein.append(
                {"session": i, "line": line.label, "response_id": rid, "stop_ms": round(stops[-1][1], 1)}
            )
        turn = session.ledger.turn(rid)
        marks = [(m.char_start, m.char_end, m.sample_start, m.sample_end) for m in turn.marks]
        truth = heard_by_marks(turn.text, marks, caller.played(rid))
        told = [m["content"] for m in session.conversation.messages() if m["role"] == "assistant"]
        if truncated.data["transcript"] == truth and truth in told:
            exact += 1
        else:
            kept = truncated.data["transcript"]
            inexact.append(
                {"session": i, "response_id": rid, "heard": truth, "kept": kept, "in_history": kept in told}
            )
    missed = [k for k in said if k not in stopped and _played_on(caller, caller.voice_spans[k][0])]
    return {
        "v2v_ms": v2v,
        "stops": stops,
        "missed": [
            {"session": i, "id": session.id, "line": spoken[k], "at": _wall_clock(caller.voice_spans[k][0])}
            for k in missed
        ],
        "unplayed": len(said) - len(stopped) - len(missed),
        "bargein_samples": bargein,
        "cuts": cuts,
        "exact": exact,
        "inexact": inexact,
        "self_interruptions": _self_interruptions(caller, session.turns.pauses),
        "audio_gaps": _audio_gaps(caller),
        "replies": len(created),
        "heard_s": sum(f.samples for f in caller.frames) / engines.tts.sample_rate,
        "breakdowns": [e.data for e in caller.of_type(ev.METRICS)],
        "v2v_samples": samples,
    }


def _audio_gaps(caller: VirtualCaller, gap_s: float = 0.1) -> int:
    """Silences of over ``gap_s`` inside a reply that no caller voice explains (it paused
    the reply): its audio ran out before the reply did."""
    gaps = 0
    by_reply: dict[str, list[float]] = {}
    for frame in caller.frames:
        by_reply.setdefault(frame.response_id, []).append(frame.at)
    for times in by_reply.values():
        for before, after in itertools.pairwise(times):
            if after - before > gap_s:  # a voice up to 0.5 s before it may have paused the reply
                gaps += not any(s < after and e > before - 0.5 for s, e in caller.voice_spans)
    return gaps


def _played_on(caller: VirtualCaller, onset: float) -> bool:
    """A reply's audio had begun to reach the caller before a voice's onset and went on
    for `PLAYED_ON_S` after it: the voice should have stopped it. (A reply that ended by
    itself sooner, as a short one does when the line comes at its end, had nothing left
    to stop.)"""
    for created in caller.of_type(ev.RESPONSE_CREATED):
        rid = str(created.data["response_id"])
        first, last = caller.first_frame(rid), caller.last_frame(rid)
        if first is not None and last is not None and first < onset and last >= onset + PLAYED_ON_S:
            return True
    return False


def _self_interruptions(caller: VirtualCaller, pauses: Iterable[float]) -> int:
    """Pauses of a reply (each a cut, a resume or a quick pause's false alarm) that no
    caller audio came before: in the `CALLER_REACH_S` before it, or during it. A
    recording's breath or room noise before its voiced onset is the caller's, not echo."""
    return sum(not any(s <= at and e >= at - CALLER_REACH_S for s, e in caller.sound_spans) for at in pauses)


def _wall_clock(instant: float) -> str:
    """A monotonic instant as the time of day the log gives its lines."""
    wall = time.time() - (time.monotonic() - instant)
    return time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"


def replies_to_utterances(caller: VirtualCaller) -> list[tuple[int, str, float, float]]:
    """(utterance, reply id, its first frame, the utterance's last voiced instant) for
    each utterance answered: the first reply created after the utterance began (and
    before the next one began) whose audio reached the caller. Not the first reply
    created after the voice ended: a turn judged over in a pause, or a recording whose
    quiet tail counts as voiced, has its reply created before that, and the next
    utterance's reply would be taken for it (a sample of seconds)."""
    created = caller.of_type(ev.RESPONSE_CREATED)
    spans = caller.voice_spans
    out = []
    for k, (start, end) in enumerate(spans):
        before = spans[k + 1][0] if k + 1 < len(spans) else float("inf")
        for event in created:
            rid = str(event.data["response_id"])
            first = caller.first_frame(rid)
            if start < event.at < before and first is not None:
                out.append((k, rid, first, end))
                break
    return out


async def run_sessions(
    engines: Engines,
    clips: dict[str, Speak],
    lines: list[Line],
    sessions: int,
    turns: int,
    config: SessionConfig | None = None,
) -> dict[str, Any]:
    """``sessions`` scripted callers at once (``turns``: question after question instead)."""
    config = config or SessionConfig()
    lag = LoopLag()
    lag.start()
    process = psutil.Process(os.getpid())
    rss0 = process.memory_info().rss
    cpu0 = process.cpu_times()
    synthesized0 = engines.tts.audio_s
    decoded0 = engines.llm.counters.decode_tokens
    asr_passes0, asr_busy0 = engines.asr.passes, engines.asr.busy_s
    started = time.perf_counter()
    try:
        results = await asyncio.gather(
            *(_session(engines, clips, lines, i, turns, config) for i in range(sessions))
        )
    finally:
        await lag.stop()
    lags = lag.samples_ms
    cuts = sum(r["cuts"] for r in results)
    v2v = [x for r in results for x in r["v2v_ms"]]
    stops: list[tuple[Line, float]] = [x for r in results for x in r["stops"]]
    out: dict[str, Any] = {
        "v2v_ms": percentiles(v2v),
        "bargein_stop_ms": percentiles([ms for _, ms in stops]),
        "bargein_stop_ms_by_onset": _stops_by(stops, lambda line: line.onset),
        "bargein_stop_ms_by_voice": _stops_by(stops, lambda line: line.voice),
        "truncation_exact_rate": round(sum(r["exact"] for r in results) / cuts, 3) if cuts else None,
        "barge_ins": cuts,
        "interruptions_missed": sum(len(r["missed"]) for r in results),
        "interruptions_unplayed": sum(r["unplayed"] for r in results),
        "self_interruptions": sum(r["self_interruptions"] for r in results),
        "audio_gaps": sum(r["audio_gaps"] for r in results),
        "loop_lag_p99_ms": round(float(np.percentile(lags, 99)), 1) if lags else None,
        "replies": sum(r["replies"] for r in results),
        # the replies' audio the TTS made, and what of it reached the callers (the rest was
        # cut before it played)
        "speech_synthesized_s": round(engines.tts.audio_s - synthesized0, 1),
        "speech_heard_s": round(sum(r["heard_s"] for r in results), 1),
        "llm_decoded_tokens": engines.llm.counters.decode_tokens - decoded0,  # replies' tokens and scores'
        "asr_passes": engines.asr.passes - asr_passes0,  # partial and final passes run
        "asr_busy_s": round(engines.asr.busy_s - asr_busy0, 1),  # the ASR workers' time in them
        "wall_s": round(time.perf_counter() - started, 1),
        "rss_growth_mb": round((process.memory_info().rss - rss0) / 2**20, 1),
        "v2v_samples": [x for r in results for x in r["v2v_samples"]],
        "bargein_samples": [x for r in results for x in r["bargein_samples"]],
        "missed_samples": [x for r in results for x in r["missed"]],
        "inexact_samples": [x for r in results for x in r["inexact"]],
        "end_of_turn": _end_of_turn(results),
    }
    cpu = process.cpu_times()
    cpu_s = cpu.user + cpu.system - cpu0.user - cpu0.system
    # this process's cores per session: VAD, ASR, TTS and the sessions (an in-process
    # LLM's engine core is a child process, not counted; with --llm-url there is none)
    out["cores_per_session"] = round(cpu_s / out["wall_s"] / sessions, 3)
    if turns:
        out["v2v_ms_by_turn"] = [round(x, 1) for x in results[0]["v2v_ms"]]
        out["steps_ms_by_half"] = _steps_by_half(results[0]["breakdowns"])
    return out


def _described(line: Line) -> dict[str, Any]:
    return {
        "onset": line.onset,
        "voice": line.voice,
        "text": line.text,
        "recorded": line.recording is not None,
    }


def _stops_by(stops: list[tuple[Line, float]], key: Callable[[Line], str]) -> dict[str, Any]:
    groups: dict[str, list[float]] = {}
    for line, ms in stops:
        groups.setdefault(key(line), []).append(ms)
    return {name: percentiles(values) for name, values in sorted(groups.items())}


def _end_of_turn(results: list[dict[str, Any]]) -> dict[str, Any]:
    """How the turns ended: the silence waited and the LLM's score, from the sessions'
    own per-turn metrics."""
    turns = [b for r in results for b in r["breakdowns"] if "silence_waited_ms" in b]
    scores = [b["end_of_turn_score"] for b in turns if "end_of_turn_score" in b]
    return {
        "silence_waited_ms": percentiles([b["silence_waited_ms"] for b in turns]),
        "score": percentiles(scores, digits=3),  # P(the turn is over): 0.94 is not 1.0
        "scores": sorted(scores),
    }


def _steps_by_half(breakdowns: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Median of each step of the turn's breakdown, over the first and the second half
    of a long session's turns: where any growth comes from."""
    half = len(breakdowns) // 2
    steps = sorted({k for b in breakdowns for k in b if k.endswith("_ms")})
    return {
        step: [
            round(float(np.median([b[step] for b in part if step in b] or [np.nan])), 1)
            for part in (breakdowns[:half], breakdowns[half:])
        ]
        for step in steps
    }


def clips_for(engines: Engines, utterances: list[str] | None = None) -> tuple[dict[str, Speak], list[Line]]:
    """The caller's clips by label (the questions and the story by their text), and the
    interrupting lines."""
    texts = [*QUESTIONS, STORY]
    if utterances:  # the caller's own recordings, in the order of the texts above
        if len(utterances) != len(texts):
            raise SystemExit(f"--utterances takes {len(texts)} WAV files: {', '.join(texts)}")
        audio: list[npt.NDArray[np.int16]] = []
        for path in utterances:
            samples, rate = read_wav(path)
            audio.append(resample(samples, rate, RUNTIME_RATE))
    else:
        tts = engines.tts
        audio = [resample(tts.synthesize(t).audio, tts.sample_rate, RUNTIME_RATE) for t in texts]
    interrupting, lines = interrupting_lines(engines.tts)
    return {t: Speak(a) for t, a in zip(texts, audio, strict=True)} | interrupting, lines


def with_engines(
    config: Config, body: Callable[[Engines], Awaitable[dict[str, Any]]], method: str
) -> dict[str, Any]:
    """Start the engines (deterministic voice), run ``body`` on them, close them; the
    result says how it was measured."""

    async def main() -> dict[str, Any]:
        engines = await Engines.start(config, deterministic_tts=True)
        llm = engines.llm.config
        where = engines.llm.where
        try:
            return await body(engines) | {
                "llm": {"model": os.path.basename(llm.model), "backend": where}
                | (
                    {"dtype": llm.resolved_dtype(), "execution": llm.execution}
                    if where == "in-process"
                    else {}
                )
            }
        finally:
            await asyncio.to_thread(engines.close)

    result = asyncio.run(main())
    result["method"] = method
    result["cpu"] = cpu_description()
    return result


def bench_conversation(
    config: Config,
    sessions: list[int],
    utterances: list[str] | None = None,
    turns: int = 0,
    session: SessionConfig | None = None,
) -> dict[str, Any]:
    async def body(engines: Engines) -> dict[str, Any]:
        clips, lines = clips_for(engines, utterances)
        result: dict[str, Any] = {"sessions": {}, "interruptions": [_described(line) for line in lines]}
        for n in sessions:
            result["sessions"][str(n)] = await run_sessions(engines, clips, lines, n, 0, session)
        if turns:
            result["long_session"] = await run_sessions(engines, clips, lines, 1, turns, session)
        result["session_config"] = dataclasses.asdict(session or SessionConfig())
        return result

    return with_engines(
        config,
        body,
        "real-time virtual callers with echo at -20 dB, 40-250 ms; v2v from the end of the caller's "
        "voice to the first reply frame; barge-in stop from the interrupting voice's onset to the "
        "last frame of the cut reply",
    )


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    try:
        session = SessionConfig(**json.loads(args.session_config))
    except (ValueError, TypeError, SessionError) as e:  # bad JSON, an unknown setting, or a bad value
        raise SystemExit(f"--session-config: {e}") from None
    return bench_conversation(config, sessions_of(args), args.utterances, args.turns, session)


def plot(result: dict[str, Any]) -> None:
    """Voice-to-voice by load and, for the long session, by turn."""
    fig, ax = new_plot()
    loads = sorted(result["sessions"], key=int)
    for key, label in (("p50", "voice-to-voice p50"), ("p95", "voice-to-voice p95")):
        ax.plot(
            [int(n) for n in loads], [result["sessions"][n]["v2v_ms"][key] for n in loads], "o-", label=label
        )
    stops = [result["sessions"][n]["bargein_stop_ms"]["p95"] for n in loads]
    ax.plot([int(n) for n in loads], stops, "s--", label="barge-in stop p95")
    save_plot(fig, ax, "conversation_load", "Whole sessions by load (CPU, 2 cores)", "ms", xlabel="sessions")
    if "long_session" in result:
        by_turn = result["long_session"]["v2v_ms_by_turn"]
        fig, ax = new_plot()
        ax.plot(range(1, len(by_turn) + 1), by_turn, ".-", label="voice-to-voice")
        save_plot(fig, ax, "conversation_long", f"One session, {len(by_turn)} turns", "ms", xlabel="turn")


if __name__ == "__main__":
    bench_main("conversation", measure, plot)
