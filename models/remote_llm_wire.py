"""vLLM's OpenAI-compatible completions as they come over the wire, read into this
side's types: a streamed completion's server-sent events into `Delta`s, an HTTP error
answer into `LlmError` (the request was refused) or `LlmUnavailable` (the service
failed), and `Retryable` for a failure worth sending the request again.

Kept apart from `models.remote_llm.RemoteLlm`, which owns the connection, the retries
and the bookkeeping of requests in flight: what is here is the format alone, a function
of the bytes that came in.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp

from models.llm_types import Delta, LlmError, LlmUnavailable


async def deltas(response: aiohttp.ClientResponse) -> AsyncIterator[Delta]:
    """The completion's server-sent events as deltas. vLLM sends the prompt's size with
    every event but what its prefix cache held only in the closing usage event, after
    the last token's: until then a delta's ``cached_tokens`` is None (not known yet),
    and the finished delta is held back for it."""
    finished: Delta | None = None
    done = False
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            raise LlmError(f"the LLM service sent an unreadable event: {data[:80]!r}") from None
        if "error" in event:
            raise LlmError(f"the LLM service: {event['error']}")
        usage = event.get("usage") or {}
        choices = event.get("choices") or []
        if not choices:  # the closing usage event
            details = usage.get("prompt_tokens_details") or {}
            if finished is not None and "cached_tokens" in details:
                finished = replace(finished, cached_tokens=int(details["cached_tokens"]))
            continue
        choice = choices[0]
        reason = choice.get("finish_reason")
        delta = Delta(
            list(choice.get("token_ids") or []),
            choice.get("text") or "",
            reason is not None,
            reason,
            int(usage.get("prompt_tokens") or 0),
            None,
            _first_logprobs(choice.get("logprobs")),
        )
        if reason is None:
            yield delta
        else:
            finished = delta
    if not done:  # the body ended cleanly but early: a router's replica died mid-reply
        raise LlmUnavailable("the LLM service broke off the reply")
    if finished is not None:
        yield finished


def _first_logprobs(logprobs: Any) -> dict[int, float] | None:
    """The log-probabilities asked for (``logprob_token_ids``) at the event's first
    token, from the Completions API's ``top_logprobs`` keyed ``"token_id:N"``."""
    tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    if not tops or not isinstance(tops[0], dict):
        return None
    out = {}
    for key, value in tops[0].items():
        if isinstance(key, str) and key.startswith("token_id:") and isinstance(value, int | float):
            try:
                out[int(key[9:])] = float(value)
            except ValueError:
                continue
    return out


class Retryable(Exception):
    """The service is there but this request failed in it (a 5xx answer, or its stream
    broke off): sent again when nothing of it was yielded yet, as a router's replica
    that just died is out of its ring within about a second."""


def http_error(url: str, status: int, text: str) -> LlmError:
    try:
        body = json.loads(text)
        message = body.get("error", {}).get("message") or body.get("message") or text
    except (ValueError, AttributeError):
        message = text
    message = str(message)[:500]
    if status >= 500:  # the service (or a router's replica) failed, not the request
        return LlmUnavailable(f"the LLM service at {url}: HTTP {status}: {message}")
    return LlmError(f"the LLM service refused the request: HTTP {status}: {message}")
