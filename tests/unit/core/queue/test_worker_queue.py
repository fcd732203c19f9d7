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
