"""What the remote LLM backend makes of a service that misbehaves: each answer becomes a
typed error (`LlmError` for a refused request, `LlmUnavailable` for a service that is
not there or broke off), never a hang or a stray exception.

The service here is a small aiohttp server on 127.0.0.1 that answers as vLLM's would
(its /tokenize uses the real tokenizer), isolating the client's handling of each
answer; tests/test_remote_llm.py runs the same client against vLLM itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

import models.remote_llm
from models.conversation import Conversation
from models.llm import LlmConfig
from models.llm_types import LlmError, LlmUnavailable
from models.remote_llm import RemoteLlm
from tests.conftest import free_port


def event(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def token(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": [42], "finish_reason": finish}
    return event({"choices": [choice], "usage": {"prompt_tokens": 10, "completion_tokens": 1}})


@pytest.fixture(scope="module")
def model_dir() -> str:
    from duplex.config import Config
    from models.cache import default_cache_dir
    from models.prepare import ModelChoice, prepare

    (llm,) = prepare([ModelChoice("llm", Config().llm, "none")], default_cache_dir(), progress=False)
    return llm.path


class FakeService:
    """vLLM's endpoints that start-up uses, and a completion handler a test sets."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.completion: Callable[[web.Request], object] | None = None
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.complete)
        self.server = TestServer(app, host="127.0.0.1", port=free_port())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 2048}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            text = self.tokenizer.apply_chat_template(
                body["messages"], tokenize=False, add_generation_prompt=True
            )
            return web.json_response({"tokens": self.tokenizer.encode(text, add_special_tokens=False)})
        return web.json_response({"tokens": self.tokenizer.encode(body["prompt"], add_special_tokens=False)})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        assert self.completion is not None
        return await self.completion(request)  # type: ignore[misc]


@pytest_asyncio.fixture
async def fake(model_dir: str) -> AsyncIterator[FakeService]:
    service = FakeService(model_dir)
    await service.server.start_server()
    yield service
    await service.server.close()


@pytest_asyncio.fixture
async def backend(fake: FakeService, model_dir: str) -> AsyncIterator[RemoteLlm]:
    llm = RemoteLlm(f"http://127.0.0.1:{fake.server.port}", LlmConfig(model=model_dir, max_tokens=16))
    await llm.start()
    yield llm
    await llm.aclose()


async def stream(request: web.Request, *chunks: bytes, close: bool = False) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(chunk)
    if close:  # the service broke off: no end of the chunked body
        assert request.transport is not None
        request.transport.abort()
        return response
    await response.write_eof()
    return response


async def reply_of(backend: RemoteLlm) -> str:
    return "".join([d async for d in Conversation(backend).reply("Hello?")])


async def test_a_well_formed_stream_is_a_reply(fake, backend):
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert request.headers["X-Session-ID"] and body["stream"] and isinstance(body["prompt"][0], int)
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 7}}
        return await stream(
            request,
            token("Hi"),
            token(" there", "stop"),
            event({"choices": [], "usage": usage}),
            b"data: [DONE]\n\n",
        )

    fake.completion = handler
    conversation = Conversation(backend)
    assert "".join([d async for d in conversation.reply("Hello?")]) == "Hi there"
    assert conversation.last.cached_tokens == 7 and conversation.last.settled


@pytest.mark.parametrize(
    ("logprobs", "score"),
    [
        ({"top_logprobs": [{"token_id:2": -0.5, "token_id:42": -1.2}]}, 0.6065),  # exp(-0.5)
        ({"top_logprobs": [{"token_id:42": -0.1}]}, None),  # not what was asked about
        ({"top_logprobs": [{"token_id:two": -0.5, "<|im_end|>": -0.5}]}, None),  # malformed keys
        ({"top_logprobs": [None]}, None),
        ({"top_logprobs": "garbage"}, None),
        ("garbage", None),
        (None, None),
    ],
)
async def test_the_end_of_turn_score_asks_for_one_token_and_survives_bad_answers(
    fake, backend, logprobs, score
):
    """The prefill asks the service for the log-probability of the end of the user's
    message (``logprob_token_ids``, keyed by token id); an answer without it, or a
    malformed one, leaves the score unknown (silence alone ends the turn)."""
    asked: list[dict[str, object]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked.append(body)
        choice = {"index": 0, "text": "x", "token_ids": [42], "finish_reason": "length", "logprobs": logprobs}
        usage = {"prompt_tokens": 10, "completion_tokens": 1}
        return await stream(request, event({"choices": [choice], "usage": usage}), b"data: [DONE]\n\n")

    fake.completion = handler
    conversation = Conversation(backend)
    close = conversation.format.user_close()[0]
    got = await conversation.end_of_turn("What time is it?")
    assert got == (None if score is None else pytest.approx(score, abs=1e-4))
    (body,) = asked
    assert (
        body["logprob_token_ids"] == [close]
        and body["return_tokens_as_token_ids"]
        and body["max_tokens"] == 1
    )
    assert close == 2  # SmolLM2's <|im_end|>, as the answers above name it


@pytest.mark.parametrize(
    ("status", "body", "kind", "words"),
    [
        (400, {"error": {"message": "This model's maximum context length is 2048 tokens"}}, LlmError, "2048"),
        (404, {"error": {"message": "The model `x` does not exist."}}, LlmError, "does not exist"),
        (500, {"error": {"message": "Request failed: error sending request"}}, LlmUnavailable, "500"),
        (503, "Service Unavailable", LlmUnavailable, "503"),
    ],
)
async def test_a_refused_request_is_a_typed_error(fake, backend, status, body, kind, words, monkeypatch):
    monkeypatch.setattr(models.remote_llm, "RETRY_WAITS_S", (0.01, 0.01))
    tries = 0

    async def handler(request: web.Request) -> web.Response:
        nonlocal tries
        tries += 1
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    fake.completion = handler
    with pytest.raises(LlmError) as raised:
        await reply_of(backend)
    assert type(raised.value) is kind and words in str(raised.value)
    assert tries == (3 if status >= 500 else 1)  # the service's failures are tried again


async def test_a_failure_in_the_service_before_the_first_token_is_tried_again(fake, backend, monkeypatch):
    """A router's replica that just died answers 5xx until the router takes it out."""
    monkeypatch.setattr(models.remote_llm, "RETRY_WAITS_S", (0.01, 0.01, 0.01))
    tries = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal tries
        tries += 1
        if tries < 3:
            return web.json_response({"error": {"message": "Request failed"}}, status=500)
        return await stream(request, token("Hi", "stop"), b"data: [DONE]\n\n")

    fake.completion = handler
    assert await reply_of(backend) == "Hi" and tries == 3


@pytest.mark.parametrize(
    ("chunks", "close", "kind", "words"),
    [
        ((b"data: {not json\n\n",), False, LlmError, "unreadable event"),
        ((token("Hi"), event({"error": {"message": "engine failed"}})), False, LlmError, "engine failed"),
        ((token("Hi"),), True, LlmUnavailable, "stopped answering"),
        ((token("Hi"),), False, LlmUnavailable, "broke off"),  # ended cleanly, but without [DONE]
    ],
)
async def test_a_broken_stream_is_a_typed_error(fake, backend, chunks, close, kind, words):
    fake.completion = lambda request: stream(request, *chunks, close=close)
    with pytest.raises(LlmError) as raised:
        await reply_of(backend)
    assert type(raised.value) is kind and words in str(raised.value)


async def test_nobody_listening_is_unavailable_and_marks_the_service_unreachable(fake, backend):
    await fake.server.close()
    for _ in range(2):  # the first may go out on a kept-alive connection, and find it closed
        with pytest.raises(LlmUnavailable):
            await reply_of(backend)
    assert backend.errored  # a refused connection says so at once, before the watch's probe
    assert not await backend.probe()
    with pytest.raises(LlmUnavailable, match="does not answer"):  # at once, while it is down
        await reply_of(backend)


async def test_an_abort_ends_the_reply_quietly(fake, backend):
    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(200):
            await response.write(token("la "))
            await asyncio.sleep(0.02)
        return response

    fake.completion = slow
    conversation = Conversation(backend)
    words = []
    async for delta in conversation.reply("Sing."):
        words.append(delta)
        if len(words) == 3:
            await conversation.abort()
    assert 3 <= len(words) < 200
    assert conversation.turns[-1].reply_text.startswith("la la la")


async def test_the_api_key_goes_with_every_request(fake, model_dir):
    seen = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        return await stream(request, token("Hi", "stop"), b"data: [DONE]\n\n")

    fake.completion = handler
    llm = RemoteLlm(f"http://127.0.0.1:{fake.server.port}", LlmConfig(model=model_dir), api_key="s3cret-key")
    await llm.start()
    try:
        assert await reply_of(llm) == "Hi"
    finally:
        await llm.aclose()
    assert seen == ["Bearer s3cret-key"]


async def test_a_service_that_stops_sending_fails_the_reply(fake, model_dir, monkeypatch):
    monkeypatch.setattr(models.remote_llm, "READ_TIMEOUT_S", 0.5)

    async def hung(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(token("Hi"))
        await asyncio.sleep(10)  # hung, not dead
        return response

    fake.completion = hung
    llm = RemoteLlm(f"http://127.0.0.1:{fake.server.port}", LlmConfig(model=model_dir))
    await llm.start()
    try:
        with pytest.raises(LlmUnavailable, match="stopped answering"):
            await reply_of(llm)
    finally:
        await llm.aclose()
