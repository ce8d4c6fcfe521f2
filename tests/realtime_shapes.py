"""Every event the server sends on ``WS /v1/realtime`` checked against the openai SDK's own
pydantic model for its ``type`` (the SDK builds what it receives without validating it,
so a client test alone cannot see a field missing, mistyped or made up).

`check` validates one event in strict mode (an int is not a float's stand-in the other
way round, a string is not a number) and refuses fields the model does not declare,
at any depth: the SDK's models allow extra fields and keep them silently, so a typo
or an invented field would pass unnoticed. duplex's own events are exempt, and must be
named ``duplex.*``; any other name must be one of the Realtime API's server events.

`checked_sdk` makes every event an SDK client parses go through `check` first.
"""

from __future__ import annotations

import contextlib
import json
import typing
from collections.abc import Iterator
from typing import Any

import pydantic
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from openai.types.realtime.realtime_server_event import RealtimeServerEvent

EXTENSION = "duplex."


def _models() -> dict[str, type[pydantic.BaseModel]]:
    """The SDK's server-event model for each ``type`` (from its union of them)."""
    union = typing.get_args(RealtimeServerEvent)[0]
    models: dict[str, type[pydantic.BaseModel]] = {}
    for model in typing.get_args(union):
        for name in typing.get_args(model.model_fields["type"].annotation):
            models[name] = model
    return models


MODELS = _models()


class ShapeError(AssertionError):
    """A server event that is not what the Realtime API says it is."""


def _unknown(value: Any, path: str) -> Iterator[str]:
    """Fields the SDK's models do not declare, anywhere in a validated value."""
    if isinstance(value, pydantic.BaseModel):
        for key in value.__pydantic_extra__ or {}:
            yield f"{path}.{key}"
        for name in type(value).model_fields:
            yield from _unknown(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _unknown(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _unknown(item, f"{path}.{key}")


def check(event: str | bytes | dict[str, Any]) -> dict[str, Any]:
    """The event as a dict, if it is a Realtime server event of the SDK's shape (or
    one of duplex's own, named ``duplex.*``); `ShapeError` saying what is wrong if not."""
    data = json.loads(event) if isinstance(event, (str, bytes)) else event
    kind = data.get("type") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        raise ShapeError(f"an event without a string 'type': {str(data)[:200]}")
    if kind.startswith(EXTENSION):
        return data
    model = MODELS.get(kind)
    if model is None:
        raise ShapeError(f"{kind!r} is no Realtime server event: duplex's own are named {EXTENSION}*")
    try:
        parsed = model.model_validate_json(json.dumps(data), strict=True)
    except pydantic.ValidationError as e:
        raise ShapeError(f"{kind}: {e}") from None
    unknown = list(_unknown(parsed, kind))
    if unknown:
        raise ShapeError(f"{kind}: fields the API does not define: {', '.join(unknown)}")
    return data


@contextlib.contextmanager
def checked_sdk() -> Iterator[list[str]]:
    """Every event an openai SDK realtime client parses is `check`ed first (a bad one
    raises `ShapeError` in the test, from ``recv`` or ``async for``); yields the types
    checked, in order."""
    original = AsyncRealtimeConnection.parse_event
    seen: list[str] = []

    def parse_event(self: AsyncRealtimeConnection, data: str | bytes) -> Any:
        seen.append(check(data)["type"])
        return original(self, data)

    AsyncRealtimeConnection.parse_event = parse_event  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        AsyncRealtimeConnection.parse_event = original  # type: ignore[method-assign]
