"""The ASR pass queue (`models.asr_queue`) driven with a stub runner: which passes run,
in which batches and in which order, and which are dropped. No model, no threads: the
test takes and runs the passes itself, as a worker would."""

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from models.asr_queue import MAX_BATCH, Job, PassQueue
from models.asr_types import AsrClosed, Hypothesis, Window


class StubRunner:
    """Hears each window as "w<offset>" in ``steps`` decoding steps, calling the queue's
    ``between`` before each. ``at_step[(call, step)]`` is done just before that step of
    that call: something that happens while a pass runs."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.at_step: dict[tuple[int, int], Callable[[], None]] = {}
        self.calls: list[list[int]] = []  # each call's windows, by offset
        self.finished: list[list[int]] = []  # the calls that decoded to their end
        self.timed: list[int] = []  # hypotheses given word times, by offset
        self.fail: Exception | None = None

    def transcribe_batch(
        self, windows: list[Window], between: Callable[[], None] | None = None
    ) -> list[Hypothesis]:
        call = len(self.calls)
        self.calls.append([w.offset for w in windows])
        if self.fail is not None:
            raise self.fail
        for step in range(self.steps):
            if (action := self.at_step.pop((call, step), None)) is not None:
                action()
            if between is not None:
                between()
        self.finished.append([w.offset for w in windows])
        return [Hypothesis([], f"w{w.offset}", [w.offset], w.offset) for w in windows]

    def with_times(self, hyp: Hypothesis) -> Hypothesis:
        self.timed.append(hyp.offset)
        return hyp


def job(offset: int, final: bool) -> Job:
    """A pass, told apart by its offset."""
    return Job(np.zeros(160, np.float32), offset, [], final, asyncio.get_running_loop())


def offsets(jobs: list[Job] | None) -> list[int] | None:
    return None if jobs is None else [j.offset for j in jobs]


def delivered_in(order: list[int], *jobs: Job) -> None:
    """Record the offset of each of ``jobs`` as its future completes."""

    def recorder(offset: int) -> Callable[[object], None]:
        return lambda _: order.append(offset)

    for j in jobs:
        j.future.add_done_callback(recorder(j.offset))


async def settled() -> None:
    """Let the results handed to the loop (`Job.deliver`) and their callbacks run."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_finals_go_before_partials_and_partials_run_one_at_a_time():
    queue = PassQueue()
    for j in (job(1, False), job(2, False), job(3, True), job(4, True), job(5, False)):
        queue.submit(j)
    queue.stop(1)  # a stop goes before every pass
    assert offsets(queue.take()) is None
    assert [offsets(queue.take()) for _ in range(4)] == [[3, 4], [1], [2], [5]]


async def test_finals_of_different_streams_are_batched_up_to_max_batch():
    queue = PassQueue()
    for offset in range(MAX_BATCH + 2):
        queue.submit(job(offset, True))
    queue.submit(job(100, False))
    assert MAX_BATCH == 4
    assert [offsets(queue.take()) for _ in range(3)] == [[0, 1, 2, 3], [4, 5], [100]]


async def test_cancelled_passes_are_left_out_before_they_begin():
    queue = PassQueue()
    finals = [job(offset, True) for offset in range(3)]
    partial = job(10, False)
    finals[1].cancelled = partial.cancelled = True
    for j in (*finals, partial):
        queue.submit(j)
    assert offsets(queue.take()) == [0, 2]
    assert offsets(queue.take()) == []  # the worker runs nothing


async def test_a_final_runs_between_the_steps_of_a_partial_pass():
    queue, runner = PassQueue(), StubRunner()
    partial, final_a, final_b = job(1, False), job(2, True), job(3, True)
    order: list[int] = []
    delivered_in(order, partial, final_a, final_b)

    def finals_come() -> None:
        queue.submit(final_a)
        queue.submit(final_b)

    runner.at_step[(0, 1)] = finals_come
    queue.submit(partial)
    taken = queue.take()
    assert offsets(taken) == [1] and taken is not None
    queue.run(taken, runner)
    await settled()
    assert runner.calls == [[1], [2, 3]]  # the finals, batched, at the partial's step 1
    assert runner.finished == [[2, 3], [1]]
    assert order == [2, 3, 1]
    assert [final_a.future.result().text, partial.future.result().text] == ["w2", "w1"]
    assert (queue.finals_ahead, queue.passes, queue.batches) == (1, 3, 2)


@pytest.mark.parametrize("first", ["final", "taken_as_final"])
async def test_a_final_pass_lets_no_final_run_ahead_of_it(first):
    """Neither a final pass nor a partial that a pause took as its final yields its
    steps: the final that comes meanwhile waits for the next take."""
    queue, runner = PassQueue(), StubRunner()
    running, waiting = job(1, first == "final"), job(2, True)
    if first == "taken_as_final":
        queue.take_as_final(running)
        assert running.taken_as_final and queue.finals_from_partials == 1
    runner.at_step[(0, 1)] = lambda: queue.submit(waiting)
    queue.run([running], runner)
    assert runner.calls == [[1]] and queue.finals_ahead == 0
    assert offsets(queue.take()) == [2]


async def test_a_pass_cancelled_while_it_runs_stops_at_its_next_step():
    """A partial its stream's final superseded stops at the step after the cancel: its
    future is cancelled (nobody awaits it), and the final runs as usual."""
    queue, runner = PassQueue(), StubRunner(steps=5)
    partial = job(1, False)
    runner.at_step[(0, 2)] = lambda: setattr(partial, "cancelled", True)
    queue.run([partial], runner)
    await settled()
    assert runner.calls == [[1]] and runner.finished == []
    assert partial.future.cancelled()
    assert (queue.passes, queue.batches) == (1, 1)  # it ran, though for nobody


async def test_a_partial_cancelled_while_finals_ran_ahead_stops_after_them():
    queue, runner = PassQueue(), StubRunner()
    partial, final = job(1, False), job(2, True)

    def final_supersedes_partial() -> None:
        queue.submit(final)
        partial.cancelled = True

    runner.at_step[(0, 0)] = final_supersedes_partial
    order: list[int] = []
    delivered_in(order, partial, final)
    queue.run([partial], runner)
    await settled()
    assert runner.calls == [[1], [2]] and runner.finished == [[2]]
    assert order == [2, 1] and partial.future.cancelled() and final.future.result().text == "w2"


async def test_word_times_only_for_finals_that_ask():
    queue, runner = PassQueue(), StubRunner()
    plain, timed = job(1, True), job(2, True)
    timed.word_times = True
    queue.run([plain, timed], runner)
    assert runner.timed == [2]


async def test_a_failed_pass_fails_its_requests_and_the_queue_goes_on():
    queue, runner = PassQueue(), StubRunner()
    runner.fail = ValueError("bad audio")
    first = job(1, True)
    queue.run([first], runner)
    await settled()
    with pytest.raises(ValueError, match="bad audio"):
        first.future.result()
    runner.fail = None
    second = job(2, True)
    queue.run([second], runner)
    await settled()
    assert second.future.result().text == "w2" and not queue.running


async def test_closing_fails_the_passes_waiting_and_running():
    queue = PassQueue()
    waiting, running = job(1, False), job(2, True)
    queue.submit(waiting)
    queue.running.add(running)  # as a worker holds it while it runs
    closed = AsrClosed("closed")
    queue.fail_waiting(closed)
    queue.fail_running(closed)
    await settled()
    for j in (waiting, running):
        with pytest.raises(AsrClosed):
            j.future.result()
    queue.stop(1)
    assert queue.take() is None  # the queue holds nothing else
