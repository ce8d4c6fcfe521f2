"""`Sessions`: the process-wide limits on sessions, the idle timeout, and the runtime's
metrics as `GET /metrics` exports them, with the real models."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.caller import Silence, Speak, UntilReplyDone, VirtualCaller
from duplex import events as ev
from duplex.config import Config
from duplex.events import SessionError
from duplex.health import Readiness
from duplex.http_app import build_http_app
from duplex.sessions import Sessions
from duplex.state import State
from tests.conftest import speech

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


async def test_sessions_are_refused_until_the_models_are_loaded(engines):
    sessions = Sessions(max_sessions=2, idle_timeout_s=60)
    with pytest.raises(SessionError) as info:
        await sessions.open(VirtualCaller())
    assert info.value.code == "not_ready"
    sessions.attach(engines)
    session = await sessions.open(VirtualCaller())
    assert session.state is State.LISTENING and len(sessions) == 1
    await sessions.close_all()
    assert session.state is State.CLOSED and len(sessions) == 0


async def test_one_session_over_the_limit_is_refused_and_the_others_go_on(engines, tts_engine):
    sessions = Sessions(max_sessions=2, idle_timeout_s=60)
    sessions.attach(engines)
    callers = [VirtualCaller(), VirtualCaller()]
    first, second = [await sessions.open(c) for c in callers]
    with pytest.raises(SessionError) as info:
        await sessions.open(VirtualCaller())
    assert info.value.code == "too_many_sessions" and "2 sessions" in str(info.value)
    assert len(sessions) == 2
    question = speech(tts_engine, "What is the capital city of France?")
    await callers[0].play(first, [Silence(0.2), Speak(question), UntilReplyDone(timeout=30)])
    assert "Paris" in "".join(e.data["delta"] for e in callers[0].of_type(ev.TEXT_DELTA))
    await sessions.close(second)  # a slot is free again
    third = await sessions.open(VirtualCaller())
    assert len(sessions) == 2
    await sessions.close_all()
    assert {first.state, second.state, third.state} == {State.CLOSED}


async def test_a_session_whose_client_went_quiet_is_closed_with_a_reason(engines, tts_engine):
    before = asyncio.all_tasks()
    sessions = Sessions(max_sessions=4, idle_timeout_s=1.0)
    sessions.attach(engines)
    quiet, talking = VirtualCaller(), VirtualCaller()
    gone = await sessions.open(quiet)
    alive = await sessions.open(talking)
    # the talking client keeps sending (silence counts: the transport is alive)
    await talking.play(alive, [Silence(2.5)])
    await asyncio.wait_for(gone.closed.wait(), 1)
    (error,) = quiet.of_type(ev.ERROR)
    assert error.data["error"]["code"] == "session_timeout"
    assert gone.state is State.CLOSED and alive.state is State.LISTENING and len(sessions) == 1
    await sessions.close_all()
    await asyncio.sleep(0.05)
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()


def samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    """The samples of one metric family, keyed by sample name and label values."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {(s.name, *s.labels.values()): s.value for s in family.samples}


async def test_a_turn_shows_in_get_metrics(engines, tts_engine):
    server = TestServer(build_http_app(Config(), Readiness(["llm"])))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:

            async def scrape() -> str:
                async with http.get(server.make_url("/metrics")) as r:
                    assert r.status == 200
                    return await r.text()

            before = await scrape()
            sessions = Sessions(max_sessions=1, idle_timeout_s=60)
            sessions.attach(engines)
            caller = VirtualCaller()
            session = await sessions.open(caller)
            assert samples(await scrape(), "duplex_sessions_active")[("duplex_sessions_active",)] >= 1
            question = speech(tts_engine, "What is the capital city of France?")
            await caller.play(session, [Silence(0.2), Speak(question), UntilReplyDone(timeout=30)])
            middle = await scrape()
            again = speech(tts_engine, "And what about Italy?")
            await caller.play(session, [Silence(0.5), Speak(again), UntilReplyDone(timeout=30)])
            await sessions.close_all()
            after = await scrape()
    finally:
        await server.close()
    count = "duplex_voice_to_voice_seconds_count"
    v2v_before = samples(before, "duplex_voice_to_voice_seconds")[(count,)]
    v2v_after = samples(after, "duplex_voice_to_voice_seconds")[(count,)]
    assert v2v_after == v2v_before + 2
    steps = samples(after, "duplex_turn_step_seconds")
    for step in ("endpoint", "asr_final", "llm_first_token", "first_phrase", "tts_first_audio", "send"):
        assert steps[("duplex_turn_step_seconds_count", step)] >= 1
    first, second = (m.data for m in caller.of_type(ev.METRICS))  # the same figures, as the client's events
    assert first["voice_to_voice_ms"] > 0 and second["voice_to_voice_ms"] > 0
    # the prompt of each reply: the second attends over the first exchange, whose KV it
    # reused (from the session's stream, or to the last whole 32-token block from vLLM's
    # prefix cache if a revised word made the stream start again)
    assert 0 <= first["cached_tokens"] < first["prompt_tokens"] < second["prompt_tokens"]
    assert first["prompt_tokens"] - 32 < second["cached_tokens"] < second["prompt_tokens"]

    def counted(text: str, source: str) -> float:
        return samples(text, "duplex_llm_prompt_tokens").get(("duplex_llm_prompt_tokens_total", source), 0.0)

    for m, (a, b) in zip((first, second), ((before, middle), (middle, after)), strict=True):
        assert counted(b, "cached") - counted(a, "cached") == m["cached_tokens"]
        assert counted(b, "prefilled") - counted(a, "prefilled") == m["prompt_tokens"] - m["cached_tokens"]


async def test_connections_before_their_session_hold_places_and_give_them_back(engines):
    sessions = Sessions(max_sessions=2, idle_timeout_s=60)
    sessions.attach(engines)
    with sessions.hold():
        with sessions.hold():
            with pytest.raises(SessionError) as info:  # two sockets waiting for a first message
                sessions.check_room()
            assert info.value.code == "too_many_sessions"
            with pytest.raises(SessionError), sessions.hold():
                pass
            session = await sessions.open(VirtualCaller(), holding=True)  # one of them begins
        assert len(sessions) == 1  # its place went to its session: still full
        with pytest.raises(SessionError):
            sessions.check_room()
    sessions.check_room()  # the other socket went, and gave its place back
    await sessions.close_all()
    with sessions.hold(), sessions.hold():
        pass
    assert session.state is State.CLOSED


async def test_a_session_older_than_max_session_s_is_told_and_closed(engines):
    sessions = Sessions(max_sessions=2, idle_timeout_s=60, max_session_s=1.0)
    sessions.attach(engines)
    caller = VirtualCaller()
    session = await sessions.open(caller)
    async with asyncio.timeout(10):
        while not session.closed.is_set():
            session.touch()  # not idle: it is closed for its age
            await asyncio.sleep(0.05)
    assert [e.data["error"]["code"] for e in caller.of_type(ev.ERROR)] == ["session_expired"]
    assert len(sessions) == 0
    await sessions.close_all()


async def test_while_an_engine_is_out_new_sessions_are_refused_with_its_error(engines):
    sessions = Sessions(max_sessions=2, idle_timeout_s=60)
    sessions.attach(engines)
    caller = VirtualCaller()
    live = await sessions.open(caller)
    sessions.set_unavailable(SessionError("llm_unavailable", "the LLM engine stopped"))
    with pytest.raises(SessionError) as info:
        await sessions.open(VirtualCaller())
    assert info.value.code == "llm_unavailable" and len(sessions) == 1
    sessions.set_unavailable(None)
    await sessions.open(VirtualCaller())
    await sessions.close_all(SessionError("shutting_down", "the server is shutting down"))
    assert live.state is State.CLOSED
    assert [e.data["error"]["code"] for e in caller.of_type(ev.ERROR)] == ["shutting_down"]
