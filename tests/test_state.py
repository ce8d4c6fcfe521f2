"""The session state machine against its whole transition table, every pair of states."""

import itertools

import pytest

from duplex.state import State, StateMachine

S = State
# Written out here, not read from the module: the test is the second copy of the table.
ALLOWED: dict[State, set[State]] = {
    S.IDLE: {S.LISTENING, S.CLOSED},
    S.LISTENING: {S.USER_SPEAKING, S.RESPONDING, S.CLOSED},
    S.USER_SPEAKING: {S.LISTENING, S.RESPONDING, S.CLOSED},
    S.RESPONDING: {S.LISTENING, S.INTERRUPTED, S.USER_SPEAKING, S.CLOSED},
    S.INTERRUPTED: {S.RESPONDING, S.USER_SPEAKING, S.LISTENING, S.CLOSED},
    S.CLOSED: set(),
}
# An allowed way from IDLE to each state.
ROUTE: dict[State, list[State]] = {
    S.IDLE: [],
    S.LISTENING: [S.LISTENING],
    S.USER_SPEAKING: [S.LISTENING, S.USER_SPEAKING],
    S.RESPONDING: [S.LISTENING, S.RESPONDING],
    S.INTERRUPTED: [S.LISTENING, S.RESPONDING, S.INTERRUPTED],
    S.CLOSED: [S.CLOSED],
}
PAIRS = list(itertools.product(State, State))


class Recorder:
    def __init__(self) -> None:
        self.changes: list[tuple[State, State]] = []

    def __call__(self, old: State, new: State) -> None:
        self.changes.append((old, new))


def machine_in(state: State) -> tuple[StateMachine, Recorder]:
    changes = Recorder()
    machine = StateMachine(changes)
    for step in ROUTE[state]:
        assert machine.to(step)
    assert machine.state is state
    changes.changes.clear()
    return machine, changes


def test_the_tables_cover_every_state():
    assert set(ALLOWED) == set(ROUTE) == set(State)
    assert len(PAIRS) == 36


def test_a_new_machine_is_idle_and_silent():
    changes = Recorder()
    machine = StateMachine(changes)
    assert machine.state is State.IDLE and changes.changes == []


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a.value}->{b.value}" for a, b in PAIRS])
def test_every_transition(old: State, new: State):
    machine, changes = machine_in(old)
    if new is old:
        assert machine.to(new) is False
        assert machine.state is old and changes.changes == []
    elif new in ALLOWED[old]:
        assert machine.to(new) is True
        assert machine.state is new and changes.changes == [(old, new)]
    else:
        with pytest.raises(AssertionError, match=f"session state {old.value} -> {new.value}"):
            machine.to(new)
        assert machine.state is old and changes.changes == []


def test_the_table_allows_exactly_these_moves():
    allowed = set()
    for old, new in PAIRS:
        machine, _ = machine_in(old)
        try:
            if machine.to(new):
                allowed.add((old, new))
        except AssertionError:
            pass
    assert allowed == {(old, new) for old, targets in ALLOWED.items() for new in targets}
    assert len(allowed) == 16


@pytest.mark.parametrize("old", list(State), ids=[s.value for s in State])
def test_closed_is_reachable_from_every_state_and_final(old: State):
    machine, changes = machine_in(old)
    assert machine.to(State.CLOSED) is (old is not State.CLOSED)
    assert machine.state is State.CLOSED
    for new in State:
        if new is State.CLOSED:
            assert machine.to(new) is False
        else:
            with pytest.raises(AssertionError):
                machine.to(new)
        assert machine.state is State.CLOSED
    assert changes.changes == ([] if old is State.CLOSED else [(old, State.CLOSED)])


def test_a_conversation_reports_each_change_once_in_order():
    changes = Recorder()
    machine = StateMachine(changes)
    steps = [S.LISTENING, S.USER_SPEAKING, S.USER_SPEAKING, S.RESPONDING, S.INTERRUPTED, S.RESPONDING]
    steps += [S.INTERRUPTED, S.USER_SPEAKING, S.LISTENING, S.LISTENING, S.CLOSED, S.CLOSED]
    moved = [machine.to(s) for s in steps]
    assert moved == [True, True, False, True, True, True, True, True, True, False, True, False]
    assert changes.changes == [
        (S.IDLE, S.LISTENING),
        (S.LISTENING, S.USER_SPEAKING),
        (S.USER_SPEAKING, S.RESPONDING),
        (S.RESPONDING, S.INTERRUPTED),
        (S.INTERRUPTED, S.RESPONDING),
        (S.RESPONDING, S.INTERRUPTED),
        (S.INTERRUPTED, S.USER_SPEAKING),
        (S.USER_SPEAKING, S.LISTENING),
        (S.LISTENING, S.CLOSED),
    ]
