"""Faults inside the process: TTS that raises, engine workers that die, an LLM that
stops, a watcher round that fails. The real engines (ASR, TTS, the shared vLLM
engine) where the fault is theirs; a stand-in LLM only where its death must be staged
without killing the engine the rest of the suite shares (tests/test_faults_served.py
kills a real one, in a running service)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import pytest

from benchmarks.caller import VirtualCaller
from duplex import events as ev
from duplex.engine_watch import EngineWatch
from duplex.engines import Engines
from duplex.events import SessionError
from duplex.health import ComponentState, Readiness
from duplex.session import Session
from duplex.session_config import SessionConfig
from duplex.sessions import Sessions
from duplex.supervise import every
from models.asr import AsrEngine
from models.tts import TtsEngine

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


class WorkerKilled(BaseException):
    """What ends a worker thread (not an `Exception`: the worker does not catch it)."""


async def until(predicate: Any, within: float = 40.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 (the caller records; nothing to await)
            await asyncio.sleep(0.02)


async def one_text_turn(session: Session, caller: VirtualCaller, text: str) -> list[ev.Event]:
    done = len(caller.of_type(ev.RESPONSE_DONE))
    await session.push_text(text)
    await until(lambda: len(caller.of_type(ev.RESPONSE_DONE)) > done)
    return caller.of_type(ev.RESPONSE_DONE)[done:]


class FailingSynthesis:
    """The shared TTS engine, made to raise on the second phrase of a reply while `on`."""

    def __init__(self, engine: TtsEngine) -> None:
        self.real = engine.pieces
        self.tried: list[str] = []
        self.on = True

    def __call__(self, text: str, first_frames: int | None = None, stop: Any = None) -> Any:
        self.tried.append(text)
        if self.on and len(self.tried) == 2:
            raise RuntimeError("the voice model failed")
        return self.real(text, first_frames, stop)


async def test_a_tts_exception_ends_the_reply_failed_with_an_error_never_a_hang(engines, monkeypatch):
    failing = FailingSynthesis(engines.tts)
    monkeypatch.setattr(engines.tts, "pieces", failing)
    caller = VirtualCaller()
    session = Session(engines, caller, SessionConfig())
    await session.start()
    try:
        (done,) = await one_text_turn(session, caller, "Tell me a long story about a dragon and a knight.")
        assert done.data["status"] == "failed"
        assert [e.data["error"]["code"] for e in caller.of_type(ev.ERROR)] == ["tts_error"]
        assert caller.of_type(ev.AUDIO_DELTA)  # the first phrase, synthesized before it, was heard
        heard = session.ledger.heard_text(done.data["response_id"])
        assert heard.strip() == failing.tried[0]  # and nothing after the phrase that failed
        assert session.conversation.turns[-1].reply_text == heard  # the history: what was heard
        failing.on = False  # the session goes on: its next reply completes
        (done,) = await one_text_turn(session, caller, "Say hello.")
        assert done.data["status"] == "completed"
        assert len(caller.of_type(ev.ERROR)) == 1
    finally:
        await session.close()


def kill_worker_once(engine: Any, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's next job ends its worker thread (as a fault in native code would)."""
    real = getattr(engine, method)
    calls = 0

    def dying(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise WorkerKilled
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, method, dying)


class DeadLlm:
    """A stand-in for `LlmEngine`'s life-cycle surface: dead until restarted, and its
    restarts fail ``failing`` times first. The real engine's death is in
    tests/test_faults_served.py."""

    restartable = True

    def __init__(self, failing: int = 0) -> None:
        self.errored = True
        self.started = True
        self.failing = failing
        self.restarts = 0
        self.proceed = asyncio.Event()
        self.proceed.set()

    async def restart(self) -> None:
        self.restarts += 1
        await self.proceed.wait()
        if self.restarts <= self.failing:
            raise RuntimeError("the engine core did not start")
        self.errored = False


def watch_of(
    engines: Engines, llm: Any = None, **kwargs: Any
) -> tuple[EngineWatch, Readiness, Sessions, list[str]]:
    readiness = Readiness(["vad", "asr", "tts", "llm"])
    for name in ("vad", "asr", "tts", "llm"):
        readiness.set(name, ComponentState.READY, f"model-{name}")
    sessions = Sessions(4, 60)
    parts = Engines(engines.vad, engines.asr, engines.tts, llm if llm is not None else engines.llm)
    sessions.attach(parts)
    gave_up: list[str] = []
    return EngineWatch(parts, readiness, sessions, gave_up.append, **kwargs), readiness, sessions, gave_up


@pytest.mark.parametrize("component", ["tts", "asr"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker's death
async def test_a_dead_worker_fails_its_job_turns_health_and_is_restarted(engines, component, monkeypatch):
    engine: TtsEngine | AsrEngine = getattr(engines, component)
    watch, readiness, sessions, gave_up = watch_of(engines)
    changes: list[bool] = []
    readiness.on_change(changes.append)
    if isinstance(engine, TtsEngine):
        kill_worker_once(engine, "pieces", monkeypatch)
        job = engine.stream()
        job.push_text("Hello there.")
        job.end_text()
        with pytest.raises(RuntimeError, match="worker stopped"):
            async for _ in job.frames():
                pass
    else:
        kill_worker_once(engine, "transcribe_batch", monkeypatch)
        with pytest.raises(RuntimeError, match="worker stopped"):
            await engine.transcribe_queued(np.zeros(16000, np.int16))
    await until(lambda: not engine.alive, within=5)
    await watch.check()
    assert engine.alive
    assert changes == [False, True]  # not ready while it was down, ready again
    assert readiness.ready and readiness.detail(component) == f"model-{component}"
    assert sessions.unavailable is None and not gave_up
    if isinstance(engine, AsrEngine):  # the restarted worker serves the queue
        assert await engine.transcribe_queued(np.zeros(16000, np.int16)) == ""


async def test_a_dead_llm_turns_health_refuses_sessions_and_comes_back(engines):
    llm = DeadLlm()
    llm.proceed.clear()  # the restart takes its time
    watch, readiness, sessions, gave_up = watch_of(engines, llm)
    checking = asyncio.create_task(watch.check())
    await until(lambda: llm.restarts == 1, within=5)
    snapshot = readiness.snapshot()
    assert snapshot["status"] == "restarting" and not readiness.ready
    assert snapshot["components"]["llm"]["state"] == "restarting"  # type: ignore[index]
    with pytest.raises(SessionError) as refused:
        sessions.check_room()
    assert refused.value.code == "llm_unavailable"
    llm.proceed.set()
    await checking
    assert readiness.ready and readiness.detail("llm") == "model-llm"
    sessions.check_room()  # admitted again
    assert not gave_up


async def test_restarts_back_off_then_the_service_gives_up(engines):
    llm = DeadLlm(failing=10)
    watch, readiness, sessions, gave_up = watch_of(engines, llm, backoff_s=(0.01, 0.02, 0.04))
    await watch.check()
    assert llm.restarts == 3
    assert gave_up and "could not be restarted" in gave_up[0]
    assert not readiness.ready


async def test_an_llm_that_keeps_dying_ends_the_service(engines):
    llm = DeadLlm()
    watch, _, _, gave_up = watch_of(engines, llm)
    for _ in range(6):
        llm.errored = True
        await watch.check()
    assert llm.restarts == 5 and len(gave_up) == 1 and "stopped 6 times" in gave_up[0]


class FarLlm:
    """A stand-in for `RemoteLlm`'s reachability: a service that answers or does not.
    Against vLLM's own server: tests/test_remote_llm.py."""

    restartable = False

    def __init__(self) -> None:
        self.answers = True
        self.probes = 0
        self.errored = False  # as the last probe found

    async def probe(self) -> bool:
        self.probes += 1
        self.errored = not self.answers
        return self.answers


async def test_an_unreachable_llm_service_is_waited_for_never_restarted(engines):
    llm = FarLlm()
    watch, readiness, sessions, gave_up = watch_of(engines, llm)
    await watch.check()
    assert readiness.ready and llm.probes == 1
    llm.answers = False
    llm.errored = True  # as a request that found nobody listening leaves it
    for _ in range(10):  # however long it lasts: health says so, nothing restarts, no exit
        await watch.check()
    snapshot = readiness.snapshot()
    assert snapshot["status"] == "unreachable" and not readiness.ready
    assert snapshot["components"]["llm"]["state"] == "unreachable"
    with pytest.raises(SessionError) as refused:
        sessions.check_room()
    assert refused.value.code == "llm_unavailable" and "unreachable" in str(refused.value)
    assert llm.probes == 11 and not gave_up  # every round while it does not answer
    llm.answers = True
    await watch.check()
    assert readiness.ready and readiness.detail("llm") == "model-llm"
    sessions.check_room()
    await watch.check()  # answering: the next probe waits for its period
    assert llm.probes == 12


async def test_a_watcher_round_that_fails_is_logged_and_the_next_one_runs(caplog):
    rounds = 0

    async def round_() -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            raise RuntimeError("a bug in one round")

    task = asyncio.create_task(every(0.01, round_, "test watcher"))
    with caplog.at_level(logging.ERROR, logger="duplex.supervise"):
        await until(lambda: rounds >= 3, within=5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert "test watcher: a round failed" in caplog.text and "a bug in one round" in caplog.text
