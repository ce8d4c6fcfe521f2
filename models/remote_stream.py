"""`RemoteStream`: a session's chunks as requests to the LLM service, each on the
session's growing prefix (`models.llm_backend.TokenStream`; the in-process engine's
counterpart is `models.kv_stream`).

Every chunk is one streamed completion whose prompt is all the session's tokens so far
and the chunk: the service's prefix cache, not this object, holds the session's KV.
Here is only the bookkeeping of what the service has seen (``tokens``): a chunk that
finished adds its prompt and what was generated (less the last token, which the next
chunk's prompt will carry); a chunk that did not (stopped, failed) ends the stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

from models.llm_types import Constraint, Delta, LlmError


class Completions(Protocol):
    """What a stream asks of the service's client (`models.remote_llm.RemoteLlm`)."""

    def complete(
        self,
        request_id: str,
        session_key: str,
        prompt: list[int],
        max_tokens: int,
        ignore_eos: bool,
        wire_id: str | None = None,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[Delta]: ...


class RemoteStream:
    """A session's chunks as requests on the growing prefix (`models.llm_backend`)."""

    def __init__(self, backend: Completions, request_id: str, session_key: str) -> None:
        self.backend = backend
        self.request_id = request_id
        self.session_key = session_key
        self.tokens: list[int] = []  # what the server's prefix cache has of this session
        self.alive = True
        self.busy = False
        self._chunks = 0

    @property
    def resumes(self) -> bool:
        return False  # every chunk is a new request: the server counts what it found cached

    async def run(
        self,
        chunk: list[int],
        max_tokens: int,
        ignore_eos: bool = False,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncGenerator[Delta, None]:
        assert not self.busy, "one chunk at a time"
        if not self.alive:
            raise LlmError("the session's LLM stream has ended")
        if not chunk:
            raise ValueError("an empty chunk")
        self.busy = True
        prompt = self.tokens + chunk
        self._chunks += 1
        generated: list[int] = []
        finished = False
        try:
            async for delta in self.backend.complete(
                self.request_id,
                self.session_key,
                prompt,
                max_tokens,
                ignore_eos,
                wire_id=f"{self.session_key}-{self.request_id}-c{self._chunks}",
                logprobs_of=logprobs_of,
                constraint=constraint,
            ):
                generated += delta.token_ids
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            self.busy = False
            if finished:
                self.tokens = prompt + generated[:-1]
            else:
                self.alive = False

    def close(self) -> None:
        self.alive = False
