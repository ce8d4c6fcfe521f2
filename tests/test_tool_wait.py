"""What the caller hears while the client's functions run (`duplex.tool_wait`), decided
without models: a stub conversation keeps the results, a stub session says what it is
told to and tells whether anyone speaks. The same with the real session, models and a
real client: tests/test_realtime.py (the filler, the timeout)."""

import asyncio
from typing import Any, cast

from duplex import events as ev
from duplex.session_config import SessionConfig
from duplex.state import State
from duplex.tool_wait import TIMED_OUT, ToolWait
from models.tools import ToolCall, ToolError


class Results:
    """The conversation as the wait sees it: which calls have their results."""

    def __init__(self) -> None:
        self.results: dict[str, str] = {}
        self.gone: set[str] = set()  # calls whose turns left the conversation

    def call(self, call_id: str) -> object | None:
        return None if call_id in self.gone else call_id

    def answered(self, call_id: str) -> bool:
        return call_id in self.results

    def add_result(self, call_id: str, output: str) -> None:
        if call_id in self.results:
            raise ToolError(f"call {call_id!r} has its result already", "invalid_call_id")
        self.results[call_id] = output


class Room:
    """The session as the wait sees it."""

    def __init__(self, **config: Any) -> None:
        self.config = SessionConfig(**config)
        self.reply: object | None = None
        self.state = State.LISTENING
        self.said: list[str] = []
        self.events: list[tuple[str, dict[str, object]]] = []

    def say(self, text: str) -> None:
        self.said.append(text)

    def emit(self, type_: str, **data: object) -> None:
        self.events.append((type_, data))


def waiting(**config: Any) -> tuple[ToolWait, Results, Room]:
    results, room = Results(), Room(**config)
    return ToolWait(cast(Any, results), cast(Any, room)), results, room


async def test_a_result_that_comes_in_time_leaves_nothing_said():
    wait, results, room = waiting(tool_filler_ms=200)
    call = ToolCall("get_weather", '{"city": "Paris"}')
    wait.watch([call])
    await asyncio.sleep(0.05)
    results.add_result(call.call_id, "{}")
    await asyncio.sleep(0.3)
    assert room.said == [] and room.events == [] and wait.fillers == 0
    assert wait._task is not None and wait._task.done()  # the wait ended with its last result


async def test_a_late_result_gets_one_filler_said_when_nobody_speaks():
    wait, results, room = waiting(tool_filler_ms=100, tool_filler_text="Let me check.")
    first, second = ToolCall("a", "{}"), ToolCall("b", "{}")
    room.state = State.USER_SPEAKING  # the caller speaks when the filler is due: it waits
    wait.watch([first, second])
    await asyncio.sleep(0.25)
    assert room.said == []
    room.state = State.LISTENING
    wait.poke()  # (the session pokes on every change of its state)
    await asyncio.sleep(0.05)
    assert room.said == ["Let me check."]
    await asyncio.sleep(0.2)
    assert room.said == ["Let me check."] and wait.fillers == 1  # once for the calls of one reply
    results.add_result(first.call_id, "{}")
    results.add_result(second.call_id, "{}")
    wait.poke()
    await asyncio.sleep(0.05)
    assert wait._task is not None and wait._task.done()
    await wait.close()


async def test_no_filler_when_it_is_turned_off():
    wait, _, room = waiting(tool_filler_ms=0, tool_timeout_s=0.5)
    wait.watch([ToolCall("a", "{}")])
    await asyncio.sleep(0.3)
    assert room.said == []
    await wait.close()


async def test_a_call_with_no_result_is_answered_as_failed_and_the_caller_told():
    wait, results, room = waiting(tool_filler_ms=0, tool_timeout_s=0.5, tool_timeout_text="No luck.")
    call = ToolCall("get_weather", '{"city": "Paris"}')
    wait.watch([call])
    await asyncio.sleep(0.3)
    assert room.events == []
    await asyncio.sleep(0.4)
    assert results.results == {call.call_id: TIMED_OUT}  # in the history: a late result is refused
    told = {"call_id": call.call_id, "name": "get_weather", "timeout_s": 0.5}
    assert room.events == [(ev.TOOL_TIMEOUT, told)]
    assert room.said == ["No luck."] and wait.timeouts == 1
    assert wait._task is not None and wait._task.done()


async def test_a_timeout_while_someone_speaks_is_told_but_not_said():
    wait, results, room = waiting(tool_filler_ms=0, tool_timeout_s=0.5)
    room.reply = object()  # the caller's next turn is being answered
    call = ToolCall("a", "{}")
    wait.watch([call])
    await asyncio.sleep(0.7)
    assert [type_ for type_, _ in room.events] == [ev.TOOL_TIMEOUT] and room.said == []
    assert results.answered(call.call_id)


async def test_calls_watched_again_are_not_awaited_twice_and_close_stops_the_wait():
    wait, _, room = waiting(tool_filler_ms=0, tool_timeout_s=0.5)
    call = ToolCall("a", "{}")
    wait.watch([call])
    await asyncio.sleep(0.3)
    wait.watch([call])  # a later reply ended with the same call still outstanding: its clock runs on
    await asyncio.sleep(0.35)
    assert [type_ for type_, _ in room.events] == [ev.TOOL_TIMEOUT]
    wait.watch([ToolCall("b", "{}")])
    await wait.close()
    assert wait._task is not None and wait._task.cancelled()


async def test_a_call_whose_turn_left_the_conversation_is_no_longer_awaited():
    wait, results, room = waiting(tool_filler_ms=0, tool_timeout_s=0.5)
    kept, deleted = ToolCall("a", "{}"), ToolCall("b", "{}")
    wait.watch([kept, deleted])
    results.gone.add(deleted.call_id)  # the client deleted the turn that made it
    await asyncio.sleep(0.7)
    assert [data["call_id"] for _, data in room.events] == [kept.call_id]
    assert set(results.results) == {kept.call_id} and wait.timeouts == 1
