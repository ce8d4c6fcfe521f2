"""`KvBudget`: which sessions' KV the cache keeps, as plain numbers.

The KV cache has ``num_blocks`` blocks of ``block_size`` tokens, shared by every
session's resumable request (`models.kv_stream.KvStream`). The budget keeps, per
session (its request id), how many tokens its KV holds, how many more a chunk in
flight may add, and the order in which sessions were last used. Before a chunk runs,
`reserve` says which idle sessions must give up their KV so that the books fit the
cache: least recently used first.

    one session's books:  [ tokens: settled KV ][ reserved: chunk + max_tokens ]
                          '-- counted as blocks(tokens + reserved), rounded up --'

    the sessions, by use:  least recent                          most recent
                           | idle a | busy b | idle c | ... | idle z |
                             ^ evicted first, busy ones skipped, until the books fit

It holds integers, ids and an order only: the tensors are vLLM's, and closing an
evicted session's request is the caller's job (`models.llm.LlmEngine.reserve`).

Invariants:

- a session is on the books from `open` until `free`, or until `reserve` evicts it;
- ``reserved > 0`` exactly while a chunk of the session is in flight (it is "busy"),
  and a busy session is never evicted: its request is running in vLLM;
- a chunk settles at no fewer tokens than before it and no more than it reserved;
- the order is the order of each session's last `open`, `reserve` or `settle`.

The books are not a hard cap: when evicting every idle session is not enough, the
chunk goes ahead anyway (vLLM queues it, or preempts, until busy sessions finish).
Only a chunk that could not fit even in an empty cache is refused, and that is an
ordinary answer (`None`), not an error. Blocks a session shares with another through
vLLM's prefix cache are counted once per session, so the books err towards evicting.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Books:
    tokens: int = 0  # tokens the session's KV holds
    reserved: int = 0  # tokens the chunk in flight may add; 0 when none is


class KvBudget:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # least recently used first: `move_to_end` marks a use
        self._sessions: OrderedDict[str, _Books] = OrderedDict()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks(self, tokens: int) -> int:
        """Blocks that ``tokens`` tokens occupy (a started block is a whole block)."""
        return -(-tokens // self.block_size)

    def __contains__(self, session: str) -> bool:
        return session in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def lru(self) -> list[str]:
        """The sessions on the books, least recently used first."""
        return list(self._sessions)

    def held_tokens(self, session: str) -> int:
        """Tokens counted for ``session``: its KV, plus its chunk in flight's reservation."""
        books = self._books(session, "held_tokens")
        return books.tokens + books.reserved

    def busy(self, session: str) -> bool:
        return self._books(session, "busy").reserved > 0

    def blocks_in_use(self) -> int:
        """Blocks the books count, over every session (may exceed ``num_blocks``)."""
        return sum(self.blocks(b.tokens + b.reserved) for b in self._sessions.values())

    def open(self, session: str) -> None:
        """Put a new session on the books, holding nothing, as the most recently used."""
        assert session not in self._sessions, f"session {session!r} opened twice: a request id was reused"
        self._sessions[session] = _Books()

    def reserve(self, session: str, more_tokens: int) -> list[str] | None:
        """Count ``more_tokens`` for the chunk ``session`` is about to run.

        Returns the idle sessions to evict, least recently used first (often none):
        they are already off the books, and the caller must end their requests. Or
        `None`, with nothing changed, when the session's KV and the chunk would not
        fit even in an empty cache. ``session`` becomes the most recently used.
        """
        books = self._books(session, "reserve")
        assert books.reserved == 0, (
            f"session {session!r} reserved for a chunk while one is in flight: "
            "the caller runs one chunk at a time per session"
        )
        assert more_tokens > 0, f"a chunk reserves at least its own tokens, not {more_tokens}"
        needed = self.blocks(books.tokens + more_tokens)
        if needed > self.num_blocks:
            return None
        in_use = needed + sum(
            self.blocks(b.tokens + b.reserved) for s, b in self._sessions.items() if s != session
        )
        evicted: list[str] = []
        for other, other_books in self._sessions.items():  # least recently used first
            if in_use <= self.num_blocks:
                break
            if other == session or other_books.reserved:
                continue  # busy: its request is running
            in_use -= self.blocks(other_books.tokens)
            evicted.append(other)
        for other in evicted:
            del self._sessions[other]
        books.reserved = more_tokens
        self._sessions.move_to_end(session)
        return evicted

    def settle(self, session: str, tokens: int) -> None:
        """The chunk in flight ended and ``session``'s KV now holds ``tokens`` tokens;
        its reservation is dropped, and it becomes the most recently used."""
        books = self._books(session, "settle")
        assert books.reserved > 0, f"session {session!r} settled with no chunk in flight: settled twice?"
        assert books.tokens <= tokens <= books.tokens + books.reserved, (
            f"session {session!r} settled at {tokens} tokens, outside {books.tokens}.."
            f"{books.tokens + books.reserved}: the KV shrank, or grew past the chunk and "
            "max_tokens reserved for it (the stream's token accounting is off)"
        )
        books.tokens = tokens
        books.reserved = 0
        self._sessions.move_to_end(session)

    def free(self, session: str) -> bool:
        """Take ``session`` off the books (its request ended), whether or not a chunk is
        in flight. Whether it was on them: a session ends by paths that may overlap
        (evicted and then closed, closed and then its request ending), so freeing one
        already gone is a no-op."""
        return self._sessions.pop(session, None) is not None

    def _books(self, session: str, operation: str) -> _Books:
        books = self._sessions.get(session)
        assert books is not None, (
            f"{operation} for session {session!r}, which is not on the books: "
            "a stream used after it ended (evicted, closed or failed), or never opened"
        )
        return books
