"""WorkerQueue's counters, kept incrementally, against a scan of its outstanding requests."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from foretoken.core.queue.worker_queue import WorkerQueue
from foretoken.core.types import RequestId
from foretoken.wire.records import SchedulerSettings

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "first", "finish", "expire", "restore"]),
        st.integers(0, 7),  # request
        st.floats(0.0, 5.0),  # time step
    ),
    max_size=60,
)


def _scanned(queue: WorkerQueue) -> tuple[int, int]:
    outstanding = queue.outstanding()
    decoding = sum(1 for o in outstanding if o.first_token_s is not None)
    return decoding, len(outstanding) - decoding


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_decoding_and_unstarted_counts_match_the_outstanding_requests(ops: list) -> None:
    queue = WorkerQueue(SchedulerSettings(max_num_batched_tokens=512))
    now = 0.0
    for op, i, dt in ops:
        now += dt
        rid = RequestId(f"r{i}")
        if op == "add":
            queue.add(rid, now, 100 + 10 * i, 0, 8)
        elif op == "first":  # also before its grant: an early first token
            queue.first_token(rid, now)
        elif op == "finish":
            queue.finished(rid, now)
        elif op == "expire":
            queue.expire(now, max_age_s=4.0)
        else:
            queue = WorkerQueue.restore(queue.snapshot())
        assert (queue.decoding_count, queue.unstarted_count) == _scanned(queue)


def test_waiting_sent_before_is_about_earlier_sends_still_without_a_first_token() -> None:
    """A busy chain ends where nothing sent before a first token still waits for its own."""
    queue = WorkerQueue(SchedulerSettings(max_num_batched_tokens=512))
    a, b, c = RequestId("a"), RequestId("b"), RequestId("c")
    queue.add(a, 1.0, 100, 0, 8)
    queue.add(b, 1.5, 100, 0, 8)
    assert queue.waiting_sent_before(2.0, a)  # b waits
    queue.first_token(b, 1.8)
    assert not queue.waiting_sent_before(2.0, a)  # only a itself
    queue.add(c, 2.5, 100, 0, 8)  # sent after the first token in question
    assert not queue.waiting_sent_before(2.0, a) and queue.waiting_sent_before(3.0, a)
