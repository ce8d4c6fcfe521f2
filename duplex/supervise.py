"""`every`: a background task that runs a round of work periodically and survives its
own failures.

The service's watchers (the sessions' idle and lifetime watchdog, the engine watch)
run this way: a round that raises is logged with its traceback and the next round
runs as planned, so a bug in one round cannot silently end the watching for the rest
of the process's life. Cancellation ends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("duplex.supervise")


async def every(period_s: float, round_: Callable[[], Awaitable[None]], name: str) -> None:
    """Run ``round_`` every ``period_s`` seconds, forever; a failed round is logged."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await round_()
        except Exception:
            log.exception("%s: a round failed; it goes on", name)
