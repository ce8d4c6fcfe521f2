"""`LlmBackend`: the seam between a conversation and wherever its LLM runs.

`models.conversation.Conversation` keeps the token bookkeeping (the history, what a
turn sends, truncation to what was heard, room in the context); a backend owns how
those tokens reach a KV cache:

    Conversation ──open_stream──► TokenStream.run(chunk) ──► deltas
                                   │
         in-process (`models.llm.LlmEngine`)       remote (`models.remote_llm.RemoteLlm`)
         one resumable vLLM request per session:   vLLM's OpenAI server over HTTP: each
         the chunk is prefilled on the KV the      chunk a new request for the whole
         request holds                             prefix, whose KV the server's prefix
                                                   cache holds (to a block)

Both report per request how many prompt tokens were already cached (`Delta`), so a
turn's prefilled and reused tokens are measured the same way whichever runs it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from models.llm_types import Constraint, Delta, EngineCounters

if TYPE_CHECKING:
    from models.chat_format import ChatFormat
    from models.llm import LlmConfig


class TokenStream(Protocol):
    """One session's way into a KV cache: `tokens` is what that cache holds for it."""

    request_id: str
    tokens: list[int]
    alive: bool  # False once a chunk stopped early or the stream was closed: open another

    @property
    def resumes(self) -> bool:
        """The next chunk is prefilled on the KV this stream's own request holds (its
        cached tokens are known here); else the chunk's request is new, and the server
        says what its prefix cache supplied."""

    def run(
        self,
        chunk: list[int],
        max_tokens: int,
        ignore_eos: bool = False,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Prefill `chunk` after `tokens`, stream what is sampled; afterwards `tokens` is
        what the KV holds (the chunk and all but the last sampled token). ``logprobs_of``:
        tokens whose log-probability at the first sampled position the deltas carry;
        ``constraint``: what the sampled text is held to (`models.tools`)."""

    def close(self) -> None:
        """End the stream; its KV stays in the prefix cache until it is needed."""


class LlmBackend(Protocol):
    """What a `Conversation`, the engine watch and the benchmarks need of an LLM."""

    config: LlmConfig
    tokenizer: Any
    chat_format: ChatFormat | None
    counters: EngineCounters  # tokens prefilled and decoded for this process's requests
    where: str  # "in-process", or the LLM service's URL
    prefix_caching: bool  # off only to measure what it saves

    async def start(self) -> None: ...

    @property
    def started(self) -> bool: ...

    @property
    def errored(self) -> bool:
        """No request can be served now (the engine died, or the service is unreachable)."""

    @property
    def restartable(self) -> bool:
        """Whether `restart` brings a dead engine back (in-process), or the backend can
        only wait for its service to come back (`probe`)."""

    async def restart(self) -> None: ...

    async def probe(self) -> bool:
        """Whether the LLM answers now (updates `errored`)."""

    def shutdown(self, timeout: float = 1.5) -> None: ...

    def open_stream(self, request_id: str, session_key: str) -> TokenStream: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[Delta]:
        """One request on a whole prompt; closing the iterator early stops it."""

    async def abort(self, request_id: str) -> None:
        """Stop the request (or a stream's chunk) in flight under ``request_id``."""
