"""``duplex bench tools``: calls of a client's functions, spoken and answered in real time.

A scripted caller (`benchmarks.caller`) speaks ten tool questions in the bundled voice,
one session per client, in turn; the client answers each call after 0, 300 or 2,000 ms,
as a fast, a typical and a slow function would, and asks for the reply once every call
of the response has its result (as the gRPC client does by default). With the
``required`` choice (every question makes a call) it reports, per delay, p50/p95 of the
end of the turn to the call (``tool_call_ms``) and of the result to the reply's first
audio (``tool_result_to_audio_ms``, both from ``duplex.turn.metrics``), how many waits
got the filler (``tool_filler_ms``: 800 by default, so only the slow client's should),
and the share of calls whose arguments validate against their schema (it must be 1.0).
Then the same ten questions with ``auto``: how often the bundled model chose to call
(reported, no goal) and whether anything of a call's markup was spoken (never).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from audio_io.pcm import RUNTIME_RATE
from audio_io.resample import resample
from benchmarks.caller import Silence, Speak, UntilReplyDone, VirtualCaller
from benchmarks.common import bench_main, percentiles
from benchmarks.conversation import with_engines
from duplex import events as ev
from duplex.config import Config
from duplex.engines import Engines
from duplex.events import Event
from duplex.session import Session
from duplex.session_config import SessionConfig
from models.tools import ToolChoice, ToolLimits, parse_tools

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The time now in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
    {
        "type": "function",
        "name": "book_table",
        "description": "Book a table at the restaurant.",
        "parameters": {
            "type": "object",
            "properties": {
                "people": {"type": "integer", "minimum": 1, "maximum": 20},
                "time": {"type": "string", "description": "When, as HH:MM"},
            },
            "required": ["people", "time"],
        },
    },
]
RESULTS = {
    "get_weather": {"temp_c": 21, "sky": "sunny"},
    "get_time": {"time": "14:05"},
    "book_table": {"booked": True, "table": 7},
}
QUESTIONS = (
    "What is the weather in Paris?",
    "Is it raining in London right now?",
    "How warm is it in Madrid today?",
    "What is the weather like in Tokyo?",
    "What time is it in New York?",
    "Can you tell me the time in Sydney?",
    "What time is it in Berlin now?",
    "Please book a table for two at seven.",
    "I would like a table for four people at eight.",
    "Book a table for six at half past six, please.",
)
DELAYS_S = (0.0, 0.3, 2.0)
ANSWER_TIMEOUT_S = 40.0  # a question's call, result and answer; longer counts as failed


class Client(VirtualCaller):
    """The caller, and the client whose functions run: each call is answered after
    ``delay`` seconds, and the reply asked for once the response's calls all have results."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.session: Session | None = None
        self.calls: list[dict[str, Any]] = []
        self._answers: list[asyncio.Task[None]] = []

    def event(self, event: Event) -> None:
        super().event(event)
        if event.type == ev.CALL_DONE:
            self.calls.append(event.data)
            self._answers.append(asyncio.create_task(self._answer(event.data)))

    async def _answer(self, call: dict[str, Any]) -> None:
        await asyncio.sleep(self.delay)
        assert self.session is not None
        self.session.tools.result(call["call_id"], json.dumps(RESULTS.get(call["name"], {})))
        if self.session.tools.complete:
            await self.session.respond()

    async def settled(self) -> None:
        """Until every call has its result and the reply to them has played out."""
        assert self.session is not None
        await asyncio.gather(*self._answers)
        while self.session.reply is not None or self.session.tools.waiting:  # noqa: ASYNC110 (no event says it)
            await asyncio.sleep(0.05)


def _valid(call: dict[str, Any], schemas: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    except (ValueError, jsonschema.ValidationError, KeyError):
        return False
    return True


async def _run(engines: Engines, clips: list[Speak], delay: float, choice: ToolChoice) -> dict[str, Any]:
    client = Client(delay)
    session = Session(engines, client, SessionConfig())
    client.session = session
    tools = parse_tools(TOOLS, ToolLimits())
    session.tools.declare(tools, choice)
    await session.start()
    schemas = {t.name: t.parameters for t in tools}
    called, failed, spoken_markup = 0, 0, 0
    try:
        for clip in clips:
            before = len(client.calls)
            await client.play(session, [Silence(0.3), clip, UntilReplyDone(timeout=20)])
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT_S):
                    while True:
                        await client.play(session, [Silence(0.2)])  # (the microphone stays open)
                        if session.reply is None and not session.tools.waiting:
                            await client.settled()
                            break
            except TimeoutError:
                failed += 1
            called += len(client.calls) > before
    finally:
        await session.close()
    metrics = [e.data for e in client.of_type(ev.METRICS)]
    spoken = "".join(str(e.data["delta"]) for e in client.of_type(ev.TEXT_DELTA))
    spoken_markup = spoken.count("<tool_call") + spoken.count('"arguments"')
    return {
        "questions": len(clips),
        "questions_with_a_call": called,
        "calls": len(client.calls),
        "schema_valid_rate": round(sum(_valid(c, schemas) for c in client.calls) / len(client.calls), 3)
        if client.calls
        else None,
        "fillers": session.tool_wait.fillers,
        "timeouts": session.tool_wait.timeouts,
        "unfinished": failed,
        "markup_spoken": spoken_markup,
        "tool_call_ms": percentiles([m["tool_call_ms"] for m in metrics if "tool_call_ms" in m]),
        "tool_result_to_audio_ms": percentiles(
            [m["tool_result_to_audio_ms"] for m in metrics if "tool_result_to_audio_ms" in m]
        ),
        "result_tokens": percentiles([m["result_tokens"] for m in metrics if "result_tokens" in m]),
        "prefilled_tokens_after_results": percentiles(
            [m["prompt_tokens"] - m["cached_tokens"] for m in metrics if "result_tokens" in m]
        ),
    }


def bench_tools(config: Config, quick: bool = False) -> dict[str, Any]:
    async def body(engines: Engines) -> dict[str, Any]:
        questions = QUESTIONS[:3] if quick else QUESTIONS
        tts = engines.tts
        clips = [Speak(resample(tts.synthesize(q).audio, tts.sample_rate, RUNTIME_RATE)) for q in questions]
        result: dict[str, Any] = {"required": {}, "tool_filler_ms": SessionConfig().tool_filler_ms}
        for delay in DELAYS_S:
            started = time.monotonic()
            run = await _run(engines, clips, delay, ToolChoice("required"))
            wall = {"wall_s": round(time.monotonic() - started)}
            result["required"][f"{round(delay * 1000)}ms"] = run | wall
        result["auto"] = await _run(engines, clips, 0.0, ToolChoice("auto"))
        return result

    return with_engines(
        config,
        body,
        "a scripted caller speaks tool questions in the bundled voice in real time (one session per "
        "client delay); the client answers each call after the delay, then asks for the reply; "
        "latencies from duplex.turn.metrics",
    )


def measure(config: Config, args: argparse.Namespace) -> dict[str, Any]:
    return bench_tools(config, args.quick)


if __name__ == "__main__":
    bench_main("tools", measure)
