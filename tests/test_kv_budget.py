"""The KV cache's books (`models.kv_budget`): exact budgets and eviction order, no models."""

import pytest

from models.kv_budget import KvBudget


def budget_with(num_blocks: int, *sessions: tuple[str, int], block_size: int = 4) -> KvBudget:
    """A budget holding settled sessions, opened (and so used) in the order given."""
    budget = KvBudget(num_blocks, block_size)
    for session, tokens in sessions:
        budget.open(session)
        if tokens:
            assert budget.reserve(session, tokens) == []
            budget.settle(session, tokens)
    return budget


def test_blocks_round_up_to_whole_blocks():
    budget = KvBudget(10, 4)
    assert [budget.blocks(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert budget.capacity_tokens == 40


def test_a_reservation_that_fits_evicts_nobody_and_is_counted():
    budget = budget_with(10, ("a", 8), ("b", 4))  # 2 + 1 blocks
    assert budget.reserve("b", 9) == []  # b: 13 tokens, 4 blocks; 6 in all
    assert budget.held_tokens("b") == 13
    assert budget.busy("b") and not budget.busy("a")
    assert budget.blocks_in_use() == 6
    budget.settle("b", 12)
    assert budget.held_tokens("b") == 12 and not budget.busy("b")
    assert budget.blocks_in_use() == 5


def test_idle_sessions_are_evicted_least_recently_used_first_and_only_as_needed():
    budget = budget_with(10, ("a", 8), ("b", 8), ("c", 8), ("d", 4))  # 2+2+2+1 = 7 blocks
    # d grows to 4 + 12 = 16 tokens, 4 blocks: 2+2+2+4 = 10 fits exactly
    assert budget.reserve("d", 12) == []
    budget.settle("d", 16)
    # d grows to 16 + 9 = 25 tokens, 7 blocks: 13 > 10, so a and b go (c is enough kept)
    assert budget.reserve("d", 9) == ["a", "b"]
    assert budget.lru() == ["c", "d"]
    assert "a" not in budget and "b" not in budget
    assert budget.blocks_in_use() == 9


def test_the_exact_fit_boundary_evicts_nobody_and_one_token_more_evicts_one():
    budget = budget_with(4, ("a", 4), ("b", 4))
    assert budget.reserve("b", 8) == []  # b: 12 tokens, 3 blocks; 1 + 3 = 4
    budget.settle("b", 8)
    assert budget.reserve("b", 4) == []  # again 12 tokens: exactly the cache
    budget.settle("b", 8)
    assert budget.reserve("b", 5) == ["a"]  # 13 tokens, 4 blocks: 1 + 4 = 5 > 4
    assert budget.blocks_in_use() == 4


def test_use_orders_eviction_not_opening_order():
    budget = budget_with(6, ("a", 4), ("b", 4), ("c", 4))
    # a is used again: b is now the least recently used
    assert budget.reserve("a", 1) == []
    budget.settle("a", 4)
    assert budget.lru() == ["b", "c", "a"]
    budget.open("d")
    assert budget.reserve("d", 13) == ["b"]  # 4 + 1+1+1 = 7 > 6; 6 once b goes
    assert budget.lru() == ["c", "a", "d"]


def test_reserving_again_moves_the_session_to_most_recent():
    budget = budget_with(10, ("a", 4), ("b", 4), ("c", 4))
    assert budget.lru() == ["a", "b", "c"]
    assert budget.reserve("a", 1) == []
    assert budget.lru() == ["b", "c", "a"]  # on reserve, not only on settle
    budget.settle("a", 4)
    assert budget.lru() == ["b", "c", "a"]
    assert budget.reserve("b", 1) == []
    budget.settle("b", 5)
    assert budget.lru() == ["c", "a", "b"]


def test_busy_sessions_are_never_evicted_and_the_books_may_run_over():
    budget = budget_with(6, ("a", 8), ("b", 8), ("c", 4))  # 2+2+1 = 5
    assert budget.reserve("a", 4) == []  # a busy: 3 blocks, 6 in all
    budget.open("d")
    # d needs 3 blocks: 3 + 3 + 2 + 1 = 9 > 6; b then c (idle, least recently used)
    # go, and 3 + 3 = 6 fits; a is busy and stays
    assert budget.reserve("d", 12) == ["b", "c"]
    assert budget.lru() == ["a", "d"]
    # another 3 blocks with only busy sessions left: it goes ahead, over the cache
    budget.open("e")
    assert budget.reserve("e", 12) == []
    assert budget.blocks_in_use() == 9 > budget.num_blocks


def test_a_reservation_larger_than_the_whole_cache_is_refused_and_changes_nothing():
    budget = budget_with(4, ("a", 4), ("b", 8))
    before = (budget.lru(), budget.blocks_in_use())
    assert budget.reserve("a", 13) is None  # 17 tokens: 5 blocks > 4, even alone
    assert (budget.lru(), budget.blocks_in_use()) == before
    assert not budget.busy("a")
    assert budget.reserve("a", 12) == ["b"]  # 16 tokens: exactly the whole cache


def test_an_empty_cache_refuses_every_reservation():
    budget = KvBudget(0, 4)
    budget.open("a")
    assert budget.reserve("a", 1) is None
    assert budget.lru() == ["a"]


def test_free_takes_a_session_off_the_books_idempotently_busy_or_not():
    budget = budget_with(10, ("a", 4), ("b", 4))
    assert budget.reserve("b", 4) == []
    assert budget.free("b")  # closed mid-chunk
    assert not budget.free("b")
    assert budget.free("a")
    assert len(budget) == 0 and budget.blocks_in_use() == 0
    assert not budget.free("never-opened")


def test_an_evicted_session_is_off_the_books_and_freeing_it_again_is_a_no_op():
    budget = budget_with(2, ("a", 4), ("b", 4))
    assert budget.reserve("b", 4) == ["a"]
    assert "a" not in budget
    assert not budget.free("a")  # the caller then closes it: its own free is a no-op
    budget.open("a")  # a new stream may take the same id once the old one is gone
    assert budget.held_tokens("a") == 0


def test_a_settled_session_counts_its_tokens_not_its_reservation():
    budget = budget_with(10, ("a", 0))
    assert budget.reserve("a", 7) == []
    assert budget.held_tokens("a") == 7
    budget.settle("a", 3)  # a reply shorter than max_tokens
    assert budget.held_tokens("a") == 3 and budget.blocks_in_use() == 1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda b: b.reserve("ghost", 1), "not on the books"),
        (lambda b: b.settle("ghost", 1), "not on the books"),
        (lambda b: b.held_tokens("ghost"), "not on the books"),
        (lambda b: b.open("a"), "opened twice"),
        (lambda b: b.settle("a", 4), "no chunk in flight"),
        (lambda b: b.reserve("a", 0), "at least its own tokens"),
    ],
)
def test_broken_invariants_are_assertions_naming_the_bug(call, message):
    budget = budget_with(10, ("a", 4))
    with pytest.raises(AssertionError, match=message):
        call(budget)


def test_a_second_reservation_while_a_chunk_is_in_flight_is_a_bug():
    budget = budget_with(10, ("a", 4))
    assert budget.reserve("a", 4) == []
    with pytest.raises(AssertionError, match="one chunk at a time"):
        budget.reserve("a", 4)


@pytest.mark.parametrize("tokens", [3, 9])
def test_settling_outside_what_was_reserved_is_a_bug(tokens):
    budget = budget_with(10, ("a", 4))
    assert budget.reserve("a", 4) == []  # may settle at 4..8
    with pytest.raises(AssertionError, match="token accounting"):
        budget.settle("a", tokens)


class OldEngineBooks:
    """The bookkeeping as `LlmEngine.reserve` did it inline on its streams, before the
    budget had a module: a sort by last use over whatever streams were alive."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.capacity, self.block_size = num_blocks * block_size, block_size
        self.streams: dict[str, dict[str, int]] = {}  # tokens, reserved, last_used
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def reserve(self, session: str, more: int) -> list[str] | None:
        stream = self.streams[session]
        needed = stream["tokens"] + more
        if needed > self.capacity:
            return None
        others = {s: v for s, v in self.streams.items() if s != session}
        in_use = self.blocks(needed) + sum(self.blocks(v["tokens"] + v["reserved"]) for v in others.values())
        evicted = []
        for idle in sorted(
            (s for s, v in others.items() if not v["reserved"]), key=lambda s: others[s]["last_used"]
        ):
            if in_use <= self.capacity // self.block_size:
                break
            in_use -= self.blocks(others[idle]["tokens"])
            evicted.append(idle)
            del self.streams[idle]
        stream.update(reserved=more, last_used=self.tick())
        return evicted


def test_random_use_evicts_exactly_as_the_engine_did_before():
    import random

    rng = random.Random(0)
    outcomes = {"evicted": 0, "refused": 0}
    for _ in range(50):
        num_blocks, block_size = rng.randint(1, 12), rng.choice([1, 4, 32])
        budget, old = KvBudget(num_blocks, block_size), OldEngineBooks(num_blocks, block_size)
        names = iter(range(10**6))
        for _ in range(200):
            live = list(old.streams)
            op = rng.random()
            if op < 0.2 or not live:
                session = f"s{next(names)}"
                budget.open(session)
                old.streams[session] = {"tokens": 0, "reserved": 0, "last_used": old.tick()}
                continue
            session = rng.choice(live)
            stream = old.streams[session]
            if op < 0.3:
                assert budget.free(session)
                del old.streams[session]
            elif stream["reserved"]:
                tokens = stream["tokens"] + rng.randint(0, stream["reserved"])
                budget.settle(session, tokens)
                stream.update(tokens=tokens, reserved=0, last_used=old.tick())
            else:
                more = rng.randint(1, num_blocks * block_size // 2 + 1)
                evicted = budget.reserve(session, more)
                assert evicted == old.reserve(session, more)
                outcomes["refused" if evicted is None else "evicted"] += bool(evicted is None or evicted)
            assert budget.lru() == sorted(old.streams, key=lambda s: old.streams[s]["last_used"])
            assert all(budget.held_tokens(s) == v["tokens"] + v["reserved"] for s, v in old.streams.items())
    assert min(outcomes.values()) > 100, outcomes  # both outcomes, often
