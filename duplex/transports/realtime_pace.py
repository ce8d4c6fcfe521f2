"""`Pace`: how fast one Realtime client's events are read, as a token bucket: a pure
decision (the time now in, a wait out), so the reader (`realtime_client.read`) only
sleeps as told, and the policy is tested on its own without a clock or a socket.

A client over the rate is slowed, not refused: its reader waits, and TCP holds what it
sends meanwhile. Only a client that stays over the rate for long is closed, and that
span is measured here too (`Pace.over_s`)."""

from __future__ import annotations


class Pace:
    """A token bucket for one client's events: how long its reader waits before the
    next one. ``rate`` tokens a second, at most ``burst`` saved; an event costs its
    tokens (the bucket may go below zero, and that debt is the wait). `over_s` says how
    long the client has been over the rate: since an event first had to wait, unless
    the bucket refilled to half in between (not merely by a reader that overslept)."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = now
        self.over_since: float | None = None

    def wait_s(self, cost: float, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - cost
        self.at = now
        if self.tokens >= self.burst / 2:
            self.over_since = None
        if self.tokens >= 0:
            return 0.0
        if self.over_since is None:
            self.over_since = now
        return -self.tokens / self.rate

    def over_s(self, now: float) -> float:
        return 0.0 if self.over_since is None else now - self.over_since
