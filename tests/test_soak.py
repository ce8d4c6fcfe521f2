"""``duplex bench soak``, short: a real ``duplex serve`` child, every transport connected
and disconnected 20 times by a real client, and a 45-second spoken session; whatever a
connection took must be given back once it has gone."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.soak import TRANSPORTS, soak
from duplex.config import Config

pytestmark = pytest.mark.slow

CYCLES = 20
# The server's own steady tasks and sockets (loop-lag probe, watchdog, the scrape's own
# connection) come and go by one or two; a transport that kept one per connection would
# be 20 up.
TOLERANCE = 2


def test_connections_on_every_transport_leave_nothing_behind_and_a_long_session_is_answered():
    result = asyncio.run(soak(Config(), cycles=CYCLES, minutes=0.75, warmup=3))
    cycles = result["cycles"]
    assert cycles["failures"] == dict.fromkeys(TRANSPORTS, 0), cycles["errors"]
    assert all(cycles["connect_disconnect_ms"][t]["n"] == CYCLES for t in TRANSPORTS)
    assert cycles["sessions_left"] == 0, cycles
    growth = cycles["growth"]
    assert growth["tasks"] <= TOLERANCE, cycles
    assert growth["fds"] <= TOLERANCE, cycles
    assert growth["threads"] <= TOLERANCE, cycles
    long = result["long_session"]
    assert long["questions"] == 2 and long["replies"] >= 2, long  # at 0:02 and 0:32, each answered
    server = result["server"]
    assert server["after_long_session"]["sessions"] == 0, server
    assert server["exit_code"] == 0, server
    assert server["while_serving"]["tracebacks"] == 0, server["while_serving"]["first_traceback"]
