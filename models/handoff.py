"""Handing results from engine worker threads back to the event loop."""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


def resolve_from_thread(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], result: T | BaseException
) -> None:
    """Complete ``future`` on its loop with a result or an exception.

    Safe from any thread. A future already done (cancelled by its owner) is left as it
    is, and a closed loop (nobody waiting any more) is ignored.
    """

    def resolve() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:
        pass  # the loop is closed
