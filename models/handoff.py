"""Handing results from engine worker threads back to the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
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

    _on_loop(loop, resolve)


def cancel_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future[T]) -> None:
    """Cancel ``future`` on its loop: nobody waits for what it would have held (an
    exception set there instead would be logged as never retrieved). Safe from any
    thread; a closed loop is ignored."""
    _on_loop(loop, future.cancel)


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[[], object]) -> None:
    try:
        loop.call_soon_threadsafe(call)
    except RuntimeError:
        pass  # the loop is closed


async def in_daemon_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` in a thread of its own that does not hold up the process's exit.

    For long blocking set-ups (an engine load): the loop stays responsive, and if the
    process is told to stop meanwhile, the awaiting task can be cancelled and the
    process exit at once (`asyncio.to_thread`'s pool would be joined at exit first).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def work() -> None:
        try:
            result: T | BaseException = fn()
        except BaseException as e:  # handed to the awaiting task
            result = e
        resolve_from_thread(loop, future, result)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await future
