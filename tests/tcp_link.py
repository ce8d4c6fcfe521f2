"""`TcpLink`: a TCP forwarder on 127.0.0.1 that a test can cut and restore, to take a
service away from its clients (and bring it back) without stopping the service."""

from __future__ import annotations

import asyncio
import contextlib


class TcpLink:
    def __init__(self, port: int, target_port: int) -> None:
        self.port = port
        self.target_port = target_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port)

    async def down(self) -> None:
        """Stop listening (connections are refused) and cut every open connection."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.write_eof()
