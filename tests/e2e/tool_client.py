"""A gRPC client of `Duplex.Converse` from stubs the test generated from proto/duplex.proto
(not the project's client): it declares `get_weather`, speaks a question (16 kHz PCM16
from a file, in real time), answers the call, and prints what came back as JSON.

    python tool_client.py TARGET QUESTION.pcm STUBS_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

TOOL = {
    "name": "get_weather",
    "description": "The weather now in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
RESULT = {"temp_c": 21, "sky": "sunny"}
FRAME = 640  # 20 ms of 16 kHz PCM16


async def main(target: str, question: bytes) -> dict:
    import duplex_pb2 as pb
    import duplex_pb2_grpc as pb_grpc
    import grpc

    outgoing: asyncio.Queue = asyncio.Queue()
    tool = pb.Tool(
        name=TOOL["name"], description=TOOL["description"], parameters_json=json.dumps(TOOL["parameters"])
    )
    config = pb.SessionConfig(
        input_format=pb.AudioFormat(encoding=pb.PCM16, sample_rate=16000),
        tools=[tool],
        tool_choice=pb.ToolChoice(mode=pb.ToolChoice.FUNCTION, name="get_weather"),
    )
    await outgoing.put(pb.ClientEvent(config=config))

    async def requests():
        while True:
            item = await outgoing.get()
            if item is None:
                return
            yield item

    async def talk():
        audio = question + bytes(FRAME * 100)  # then 2 s of silence, then silence until the end
        start = time.monotonic()
        k = 0
        while True:
            chunk = audio[k * FRAME : (k + 1) * FRAME] or bytes(FRAME)
            await outgoing.put(pb.ClientEvent(audio=pb.AudioChunk(data=chunk)))
            k += 1
            await asyncio.sleep(max(0.0, start + k * 0.02 - time.monotonic()))

    summary: dict = {"calls": [], "texts": {}, "done": [], "errors": []}
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.DuplexStub(channel).Converse(requests())
        talking = asyncio.create_task(talk())
        async for event in call:
            kind = event.WhichOneof("event")
            if kind == "tool_call":
                summary["calls"].append(
                    {
                        "response_id": event.tool_call.response_id,
                        "call_id": event.tool_call.call_id,
                        "name": event.tool_call.name,
                        "arguments": json.loads(event.tool_call.arguments_json),
                    }
                )
                result = pb.ToolResult(call_id=event.tool_call.call_id, output=json.dumps(RESULT))
                await outgoing.put(pb.ClientEvent(tool_result=result))
            elif kind == "text":
                texts = summary["texts"]
                texts[event.text.response_id] = texts.get(event.text.response_id, "") + event.text.delta
            elif kind == "error":
                summary["errors"].append(event.error.code)
            elif kind == "turn" and event.turn.kind == pb.TurnEvent.RESPONSE_DONE:
                summary["done"].append([event.turn.response_id, event.turn.status])
                if len(summary["done"]) == 2:
                    break
        talking.cancel()
        await outgoing.put(None)
    return summary


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[3])
    with open(sys.argv[2], "rb") as f:
        pcm = f.read()
    print(json.dumps(asyncio.run(asyncio.wait_for(main(sys.argv[1], pcm), 120))))
