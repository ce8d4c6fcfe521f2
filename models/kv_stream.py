"""`KvStream`: one session's resumable vLLM request, whose KV holds exactly `tokens`.

vLLM 0.32 lets one request take its prompt in pieces (`StreamingInput`): each
piece ("chunk") is prefilled on top of the KV the request already holds, then
sampled with that chunk's own parameters. When a chunk stops, vLLM keeps the KV of
every token it computed and drops the last sampled token, which was never fed back:

    tokens after a chunk = tokens before + chunk + generated[:-1]

so a prefill-only chunk (one throwaway token) adds exactly its own tokens, and a
reply chunk adds the reply up to (not including) its final token: an EOS, or the
last token of a reply cut off by `max_tokens`, which the next chunk must re-send.

One chunk is in flight at a time (the owner serializes its calls), so a chunk's
outputs are never merged with the next chunk's by vLLM's output collector; a chunk
ends with the output that carries a finish reason. Abort or close ends the request: its KV blocks go back to
vLLM's prefix cache, where a new stream finds them (to block granularity).

The stream counts its KV against the cache through its engine (`StreamEngine`, which
`models.llm.LlmEngine` implements; the books are `models.kv_budget`): a reservation
before each chunk, settled when the chunk ends, released when the stream ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

from models.llm_types import Constraint, Delta, LlmError

_END = None  # the request ended (aborted, closed, or failed): no more outputs


class StreamEngine(Protocol):
    """What a `KvStream` needs of the engine that runs it (`models.llm.LlmEngine`)."""

    def reserve(self, request_id: str, more_tokens: int) -> None:
        """Count a chunk against the KV cache, making room; `LlmError` if it cannot fit."""

    def settle(self, request_id: str, tokens: int) -> None:
        """The chunk ended and the request's KV holds ``tokens`` tokens."""

    def release(self, request_id: str) -> None:
        """The request ended: its KV counts no more (idempotent)."""

    def forget(self, request_id: str) -> None:
        """The request's reader ended."""

    def streaming_input(
        self,
        chunk: list[int],
        max_tokens: int,
        ignore_eos: bool,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> Any: ...

    def generate_streaming(self, request_id: str, inputs: AsyncIterator[Any]) -> AsyncIterator[Delta]: ...

    async def abort(self, request_id: str) -> None: ...

    def abort_soon(self, request_id: str) -> None: ...


class KvStream:
    def __init__(self, engine: StreamEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.tokens: list[int] = []  # what the request's KV holds, token for token
        self.alive = True  # on the engine's KV books exactly while True
        self._inputs: asyncio.Queue[Any] = asyncio.Queue()  # StreamingInputs for vLLM
        self._outputs: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self.busy = False  # a chunk is in flight

    @property
    def resumes(self) -> bool:
        """The next chunk goes to a request that already holds KV (its own figures)."""
        return bool(self.tokens)

    async def run(
        self,
        chunk: list[int],
        max_tokens: int,
        ignore_eos: bool = False,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Prefill `chunk` on top of `tokens` and stream what is sampled after it
        (``constraint``: what it is held to, `models.tools`).

        Ends after the chunk's last output, or early when the request is aborted (then
        `alive` is False and `tokens` no longer says anything).
        """
        assert not self.busy, "one chunk at a time"
        if not self.alive:
            raise LlmError("the session's LLM stream has ended")
        if not chunk:
            raise ValueError("an empty chunk")
        self.engine.reserve(self.request_id, len(chunk) + max_tokens)
        self.busy = True
        chunk_input = self.engine.streaming_input(chunk, max_tokens, ignore_eos, logprobs_of, constraint)
        self._inputs.put_nowait(chunk_input)
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name=f"llm-{self.request_id}")
        generated: list[int] = []
        finished = False
        try:
            while True:
                item = await self._outputs.get()
                if item is _END:
                    return
                if isinstance(item, LlmError):
                    raise item
                if isinstance(item, BaseException):
                    raise LlmError(str(item)) from item
                generated += item.token_ids
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self.busy = False
            if finished:
                self.tokens += chunk + generated[:-1]
                if self.alive:  # else closed meanwhile, and already off the books
                    self.engine.settle(self.request_id, len(self.tokens))
            else:  # stopped early: what the KV holds is unknown, so the stream is done
                self._end()
                await self.engine.abort(self.request_id)

    async def _read(self) -> None:
        """Hand the request's outputs to the chunk in flight, for the request's life."""

        async def inputs() -> AsyncIterator[Any]:
            while True:
                yield await self._inputs.get()

        try:
            async for output in self.engine.generate_streaming(self.request_id, inputs()):
                self._outputs.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a chunk vLLM refused, or the engine failed
            self._outputs.put_nowait(e)
        finally:
            self._end()
            self._outputs.put_nowait(_END)
            self.engine.forget(self.request_id)

    def _end(self) -> None:
        self.alive = False
        self.engine.release(self.request_id)

    def cancel(self) -> None:
        """Drop the request without a word to vLLM (the engine is shutting down)."""
        self._end()
        if self._reader is not None:
            self._reader.cancel()

    def close(self) -> None:
        """End the request; its KV blocks return to vLLM's prefix cache.

        By abort rather than by ending the input: vLLM then sends no final request,
        which could otherwise still be on its way when the engine shuts down.
        """
        if self.alive:
            self._end()
            if self._reader is not None:
                self.engine.abort_soon(self.request_id)
        if self._reader is None:
            self.engine.forget(self.request_id)
