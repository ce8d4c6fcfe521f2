"""An async Python client of `duplex.v1.Duplex.Converse`.

    async with DuplexClient("127.0.0.1:50051") as client:
        conversation = await client.converse(input_rate=16000)
        await conversation.send_audio(pcm16_bytes)
        async for event in conversation:        # ServerEvent messages
            ...
        await conversation.close()              # half-close: the reply plays out, then the end

Messages are the generated ones (``audio_io._proto.duplex_pb2``); this wraps the stream
so that callers write ``send_audio``, ``ack``, ``say``, ``cancel`` instead of building
``ClientEvent`` oneofs. Read the events as they come: the server ends a stream whose
client has read nothing for its ``slow_reader_timeout_s`` (RESOURCE_EXHAUSTED,
``slow_reader``) once HTTP/2 flow control has stopped its writer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from audio_io._proto import duplex_pb2 as pb
from audio_io._proto import duplex_pb2_grpc as pb_grpc

MAX_MESSAGE = 4 << 20


class Conversation:
    """One Converse stream: write with the methods, read by iterating."""

    def __init__(self, call: grpc.aio.StreamStreamCall, started: pb.SessionStarted) -> None:
        self._call = call
        self.started = started
        self._writing = asyncio.Lock()  # one write at a time on a stream, from any task

    async def _write(self, message: pb.ClientEvent) -> None:
        """One write at a time, and a write once begun is finished: grpc.aio ends the
        whole RPC when a task is cancelled inside ``write``, so a caller that stops its
        sending task must not take the conversation down with it."""
        await self._writing.acquire()
        write = asyncio.ensure_future(self._call.write(message))
        write.add_done_callback(self._written)
        await asyncio.shield(write)

    def _written(self, write: asyncio.Future[None]) -> None:
        self._writing.release()
        if not write.cancelled():
            write.exception()  # retrieved here; a waiting caller gets it from the shield

    async def send_audio(self, data: bytes, capture_time: float | None = None) -> None:
        chunk = pb.AudioChunk(data=data)
        if capture_time is not None:
            chunk.capture_time = capture_time
        await self._write(pb.ClientEvent(audio=chunk))

    async def ack(self, played_samples: int) -> None:
        """The client has played this many output samples since the stream began."""
        await self._write(pb.ClientEvent(playback=pb.PlaybackAck(played_samples=played_samples)))

    async def say(self, text: str) -> None:
        await self._write(pb.ClientEvent(text=pb.TextInput(text=text)))

    async def cancel(self) -> None:
        await self._write(pb.ClientEvent(cancel=pb.Cancel()))

    async def close(self) -> None:
        """Half-close: nothing more will be sent; the server finishes the turn, then ends."""
        async with self._writing:
            await self._call.done_writing()

    def abort(self) -> None:
        """End the stream at once, from this side."""
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[pb.ServerEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[pb.ServerEvent]:
        while True:
            message = await self._call.read()
            if message is grpc.aio.EOF:
                return
            yield message

    async def status(self) -> tuple[grpc.StatusCode, str]:
        return await self._call.code(), await self._call.details()


class DuplexClient:
    def __init__(
        self, target: str, token: str | None = None, options: Sequence[tuple[str, Any]] = ()
    ) -> None:
        """``options``: more grpc channel arguments (``grpc.http2.bdp_probe``, ...)."""
        channel_options = [
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            *options,
        ]
        self.channel = grpc.aio.insecure_channel(target, options=channel_options)
        self.stub = pb_grpc.DuplexStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    async def converse(
        self,
        input_format: pb.AudioFormat | None = None,
        output_format: pb.AudioFormat | None = None,
        **options: object,
    ) -> Conversation:
        """Open a conversation and wait for SessionStarted. ``options`` are further
        SessionConfig fields (system_prompt, playback_acks, turn_taking, voice)."""
        config = pb.SessionConfig(
            input_format=input_format or pb.AudioFormat(encoding=pb.PCM16, sample_rate=16000),
            **options,  # type: ignore[arg-type]
        )
        if output_format is not None:
            config.output_format.CopyFrom(output_format)
        call = self.stub.Converse(metadata=self.metadata)
        await call.write(pb.ClientEvent(config=config))
        first = await call.read()
        if first is grpc.aio.EOF:
            raise grpc.aio.AioRpcError(
                await call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details()
            )
        return Conversation(call, first.started)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> DuplexClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
