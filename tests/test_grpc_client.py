"""The client library's stream handling, isolated from a server by a stand-in call."""

from __future__ import annotations

import asyncio

import pytest

from audio_io._proto import duplex_pb2 as pb
from duplex.grpc_client import Conversation


class HeldCall:
    """Records writes; each one waits until the test lets it through. Like grpc.aio,
    a write cancelled midway cancels the whole call."""

    def __init__(self) -> None:
        self.written: list[pb.ClientEvent] = []
        self.release = asyncio.Event()
        self.cancelled = False

    async def write(self, message: pb.ClientEvent) -> None:
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self.written.append(message)

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.asyncio
async def test_a_sender_cancelled_mid_write_leaves_the_conversation_open():
    call = HeldCall()
    conversation = Conversation(call, pb.SessionStarted())
    sender = asyncio.create_task(conversation.send_audio(b"\x00\x00"))
    await asyncio.sleep(0)
    sender.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sender
    call.release.set()
    await conversation.say("still here")  # waits for the first write, then goes
    assert not call.cancelled
    assert [m.WhichOneof("event") for m in call.written] == ["audio", "text"]
