"""`RemoteLlm`: the AR stage on vLLM's OpenAI-compatible server, over HTTP.

    front end (this process)                     LLM service (`duplex serve-llm`, or
    Conversation ─► RemoteStream ─► aiohttp ───►  vllm-router ─► replicas)
                    POST /v1/completions          prefix cache: the session's KV,
                    prompt = token ids            found again by every request
                    X-Session-ID: <session>       on the same replica

Each chunk of a session (the words prefilled while the caller speaks, then the turn)
is one streamed completion whose prompt is the whole token sequence so far, as ids:
the server's prefix cache holds the KV of what the session sent before, so only what
follows its last whole block is computed, which the server reports per request
(``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``).
A router keeps a session on one replica by the ``X-Session-ID`` header (consistent
hashing), so its KV is where its next request goes. Stopping a reply (barge-in)
closes the HTTP stream: the server aborts the request when its client goes away.

The tokenizer is loaded here from the same model the server runs, and checked against
it at start-up (`/v1/models`, `/tokenize` on a probe text and on a chat): token ids
are what travel, so both sides must agree on every one.

Reachability (`probe`, `errored`): a refused connection marks the service unreachable,
and the engine watch probes it every second (`duplex.engine_watch`). While it cannot be
reached, health says not ready and a request fails with `LlmUnavailable` after one
probe (milliseconds when connections are refused); all recovers by itself when the
service answers again.

Here: the client (start-up checks, reachability, requests with their retries and
aborts). The wire format, events into deltas and error answers into typed errors, is
`models.remote_llm_wire`; a session's chunks on its growing prefix, `models.remote_stream`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp

from models.chat_format import ChatFormat
from models.handoff import in_daemon_thread
from models.llm import LlmConfig
from models.llm_types import Constraint, Delta, EngineCounters, LlmError, LlmUnavailable
from models.remote_llm_wire import Retryable, deltas, http_error
from models.remote_stream import RemoteStream

log = logging.getLogger("duplex.llm")

SESSION_HEADER = "X-Session-ID"
CONNECT_TIMEOUT_S = 10.0  # generous: connecting on a loaded machine can take seconds (docs/performance.md)
PROBE_TIMEOUT_S = 2.0
# a service that sends nothing this long (hung, not dead) fails the request in flight
READ_TIMEOUT_S = 30.0
# waits before sending again a request that failed in the service before its first token
RETRY_WAITS_S = (0.25, 0.5, 1.0, 1.0)
WAIT_LOG_S = 10.0  # how often start-up says it is still waiting for the service
# a probe of what the tokenizer does with digits, punctuation, accents and emoji
TOKENIZER_PROBE = "Hello! It's 4:15 pm, 21.5 °C in Zürich — naïve café ☕, isn't it?"
PROBE_CHAT = [
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": TOKENIZER_PROBE},
]


class RemoteLlm:
    def __init__(
        self, url: str, config: LlmConfig, api_key: str | None = None, prefix_caching: bool = True
    ) -> None:
        self.url = url.rstrip("/")
        # off only to measure what it saves: every request then gets a cache salt of its
        # own, so the server's prefix cache finds nothing
        self.prefix_caching = prefix_caching
        self.where = self.url
        self.config = config  # model: the local copy of the server's model, for its tokenizer
        self._api_key = api_key
        self.tokenizer: Any = None
        self.chat_format: ChatFormat | None = None
        self.counters = EngineCounters()
        self.served_model = ""  # the name the server gives its model (/v1/models)
        self.reachable = False
        self._instance = uuid.uuid4().hex[:8]  # session keys are unique across front ends
        self._http: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight: dict[str, aiohttp.ClientResponse] = {}
        self._aborted: set[str] = set()
        self._closing: asyncio.Task[None] | None = None

    # -- start-up and reachability --

    async def start(self) -> None:
        """Load the tokenizer, wait until the service answers, and check that it runs the
        same tokenizer; `LlmError` naming both models if it does not."""
        self._loop = asyncio.get_running_loop()
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise

    async def _start(self) -> None:
        self.tokenizer = await in_daemon_thread(self._load_tokenizer, name="llm-tokenizer")
        self.chat_format = ChatFormat.from_tokenizer(self.tokenizer)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._http = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S
            ),
            raise_for_status=False,
        )
        waited_since = time.monotonic()
        said = 0.0
        while not await self.probe():
            if time.monotonic() - said >= WAIT_LOG_S:
                said = time.monotonic()
                log.warning(
                    "waiting for the LLM service at %s (%.0f s so far)", self.url, said - waited_since
                )
            await asyncio.sleep(0.5)
        await self._check_model()

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.config.model)

    @property
    def started(self) -> bool:
        return self.chat_format is not None and self._http is not None

    @property
    def errored(self) -> bool:
        return not self.reachable

    @property
    def restartable(self) -> bool:
        return False  # the service is someone else's process: wait for it

    async def restart(self) -> None:
        if not await self.probe():
            raise LlmUnavailable(f"the LLM service at {self.url} does not answer")

    async def probe(self) -> bool:
        """Whether the service answers now: ``GET /v1/models``, which a vLLM server
        answers while it serves and a router passes to any healthy replica (a router's
        own ``/health`` says 503 as soon as one replica is down, while the others serve)."""
        if self._http is None:
            return False
        try:
            async with self._http.get(
                f"{self.url}/v1/models", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as response:
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok != self.reachable:
            if ok:
                log.info("the LLM service at %s answers", self.url)
            else:
                log.error("the LLM service at %s does not answer", self.url)
        self.reachable = ok
        return ok

    async def _check_model(self) -> None:
        models = await self._call("GET", "/v1/models")
        try:
            served = models["data"][0]
            self.served_model = str(served["id"])
            server_context = int(served.get("max_model_len") or self.config.max_model_len)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise LlmError(f"the LLM service at {self.url} lists no model (/v1/models: {e})") from None
        name = f"{self.served_model!r} at {self.url}"
        theirs_text = await self._tokenize({"prompt": TOKENIZER_PROBE, "add_special_tokens": False})
        ours_text = self.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
        rendered = self.tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)
        theirs_chat = await self._tokenize({"messages": PROBE_CHAT, "add_generation_prompt": True})
        ours_chat = self.tokenizer.encode(rendered, add_special_tokens=False)
        for what, theirs, ours in (("text", theirs_text, ours_text), ("chat", theirs_chat, ours_chat)):
            if theirs != ours:
                at = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b), None)
                at = min(len(theirs), len(ours)) if at is None else at
                raise LlmError(
                    f"the LLM service serves {name}, whose tokenizer differs from the local model "
                    f"{self.config.model}: a probe {what} tokenizes to {theirs[at : at + 6]} there and "
                    f"{ours[at : at + 6]} here from token {at}; serve the same model on both sides"
                )
        if server_context < self.config.max_model_len:
            log.warning("the LLM service's context is %d tokens: using that", server_context)
            self.config = replace(self.config, max_model_len=server_context)
        log.info("LLM service at %s: %s, tokenizer checked", self.url, self.served_model)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One JSON request to the service, its JSON answer."""
        assert self._http is not None
        try:
            async with self._http.request(method, f"{self.url}{path}", json=body) as response:
                if response.status != 200:
                    text = await response.text()
                    raise LlmError(
                        f"{method} {path} on the LLM service: HTTP {response.status}: {text[:300]}"
                    )
                return await response.json()
        except aiohttp.ClientError as e:
            raise LlmUnavailable(f"the LLM service at {self.url}: {e}") from e

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        answer = await self._call("POST", "/tokenize", {"model": self.served_model, **body})
        tokens: list[int] = answer["tokens"]
        return tokens

    async def aclose(self) -> None:
        """Stop every request in flight and close the connections (on the loop)."""
        http, self._http = self._http, None
        for response in list(self._in_flight.values()):
            response.close()
        if http is not None:
            await http.close()

    def shutdown(self, timeout: float = 1.5) -> None:
        """`aclose` from another thread (`duplex.engines.Engines.close`), or scheduled
        on the loop when called from it."""
        loop = self._loop
        if loop is None or self._http is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._closing = loop.create_task(self.aclose())
            return
        try:
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(timeout)
        except TimeoutError:  # the loop is stuck: the process is ending anyway
            log.warning("closing the LLM service's connections took over %g s", timeout)

    # -- requests --

    def open_stream(self, request_id: str, session_key: str) -> RemoteStream:
        if self._http is None:
            raise LlmUnavailable("the LLM service's client is closed")
        return RemoteStream(self, request_id, f"{self._instance}-{session_key}")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[Delta]:
        key = f"{self._instance}-{request_id}"
        limit = max_tokens or self.config.max_tokens
        async for delta in self.complete(
            request_id, key, prompt_token_ids, limit, ignore_eos, constraint=constraint
        ):
            yield delta

    async def abort(self, request_id: str) -> None:
        """Close the request's HTTP stream: the server aborts it when its client goes."""
        response = self._in_flight.get(request_id)
        if response is not None:
            self._aborted.add(request_id)
            response.close()

    async def complete(
        self,
        request_id: str,
        session_key: str,
        prompt: list[int],
        max_tokens: int,
        ignore_eos: bool,
        wire_id: str | None = None,
        logprobs_of: list[int] | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[Delta]:
        """One streamed completion on ``prompt``, which `abort` (``request_id``) stops
        quietly; ``wire_id`` is the server's name for it (unique per request);
        ``logprobs_of``: tokens whose log-probabilities the deltas carry; ``constraint``:
        what the server holds the completion to (`models.tools`)."""
        if self._http is None:
            raise LlmUnavailable("the LLM service's client is closed")
        if not self.reachable and not await self.probe():  # (the engine watch probes too)
            raise LlmUnavailable(f"the LLM service at {self.url} does not answer; waiting for it")
        if len(prompt) + max_tokens > self.config.max_model_len:
            raise LlmError(
                f"this turn needs {len(prompt) + max_tokens} tokens, more than the context of "
                f"{self.config.max_model_len}"
            )
        body = {
            "model": self.served_model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": self.config.temperature,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if not self.prefix_caching:
            body["cache_salt"] = uuid.uuid4().hex
        if constraint is not None and constraint.structural_tag:  # vLLM's structured outputs, in the server
            body["structured_outputs"] = {"structural_tag": constraint.structural_tag}
        if constraint is not None and constraint.min_tokens:
            body["min_tokens"] = constraint.min_tokens
        if logprobs_of:  # keyed "token_id:N" in the answer, not by the token's text
            body |= {"logprobs": 1, "logprob_token_ids": logprobs_of, "return_tokens_as_token_ids": True}
        headers = {SESSION_HEADER: session_key, "X-Request-Id": wire_id or request_id}
        for attempt, wait_s in enumerate((*RETRY_WAITS_S, None)):
            said = False
            try:
                async for delta in self._post(request_id, body, headers):
                    said = True
                    yield delta
                return
            except Retryable as e:
                if said or wait_s is None:
                    raise LlmUnavailable(str(e)) from e
                log.warning("%s; trying again in %g s (attempt %d)", e, wait_s, attempt + 1)
                await asyncio.sleep(wait_s)

    async def _post(
        self, request_id: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncIterator[Delta]:
        assert self._http is not None
        last: Delta | None = None
        try:
            async with self._http.post(f"{self.url}/v1/completions", json=body, headers=headers) as response:
                if response.status != 200:
                    raise http_error(self.url, response.status, await response.text())
                self._in_flight[request_id] = response
                async for delta in deltas(response):
                    if delta.finished:
                        last = delta  # yielded after [DONE]: the connection is then reused
                    else:
                        yield delta
            if last is not None:
                self._count(last)
                yield last
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, LlmUnavailable) as e:
            if request_id in self._aborted:
                return  # `abort` closed it: the end the caller asked for
            if isinstance(e, aiohttp.ClientConnectorError):
                self.reachable = False  # nobody listens: the watch takes it from here
                raise LlmUnavailable(f"the LLM service at {self.url} does not answer: {e}") from e
            if isinstance(e, LlmUnavailable):
                raise Retryable(str(e)) from e
            raise Retryable(f"the LLM service at {self.url} stopped answering: {e}") from e
        finally:
            self._in_flight.pop(request_id, None)
            self._aborted.discard(request_id)

    def _count(self, last: Delta) -> None:
        self.counters.prefill_tokens += last.prompt_tokens - (last.cached_tokens or 0)
        self.counters.steps += 1
