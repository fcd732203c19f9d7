"""WorkerQueue's counters, kept incrementally, against a scan of its outstanding requests."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from foretoken.core.queue.scheduler import CurveStepCost, KvModel
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


def test_first_unstarted_sent_skips_decisions_nobody_acted_on_and_stale_ones() -> None:
    """What the engine's steps are timed by (core/cost/kv_steps.py): the first request sent
    there that still waits, unless nobody acted on its decision or it is too old."""
    queue = WorkerQueue(SchedulerSettings(max_num_batched_tokens=512))
    stale, asked, real, later = (RequestId(x) for x in ("stale", "asked", "real", "later"))
    for i, rid in enumerate((stale, asked, real, later)):
        queue.add(rid, float(i), 100, 0, 8)
    assert queue.first_unstarted_sent(0.0, ()) == 0.0
    assert queue.first_unstarted_sent(0.5, {asked}) == 2.0
    queue.first_token(real, 2.5)
    assert queue.first_unstarted_sent(0.5, {asked}) == 3.0
    queue.first_token(later, 3.5)
    assert queue.first_unstarted_sent(0.5, {asked}) is None


COST = CurveStepCost(lambda n: 1e-4 * n, 0.01, 1e-4)


def _decoding_two(seqs: int, kv: KvModel | None, waiting: dict[str, int]) -> WorkerQueue:
    """a (300 tokens) and b (100) start at 0 and decode from 0.1; ``waiting`` prompts (100
    output tokens each, as a and b) are sent after them."""
    settings_ = SchedulerSettings(max_num_batched_tokens=512, max_num_seqs=seqs)
    queue = WorkerQueue(settings_, kv=kv)
    for name, n in {"a": 300, "b": 100, **waiting}.items():
        queue.add(RequestId(name), 0.0, n, 0, 100)
    for name in ("a", "b"):
        queue.first_token(RequestId(name), 0.1)
    return queue


def test_a_seat_blocked_engine_with_nothing_prefilling_starts_its_head_alone() -> None:
    """Two seats, both decoding, nothing prefilling: blocked. A completion frees one seat:
    the head c starts, and d behind it cannot (no seat): c prefills alone."""
    queue = _decoding_two(2, None, {"c": 300, "d": 300})
    assert queue.admission_blocked(1.0, COST) and queue.prefill_idle(1.0, COST)
    assert queue.lone_head(1.0, COST) is None  # blocked: nothing starts
    queue.finished(RequestId("a"), 1.0)
    assert queue.lone_head(1.0, COST) == RequestId("c")


def test_a_kv_blocked_head_is_alone_only_if_the_next_one_does_not_fit_beside_it() -> None:
    """75 blocks of 10 tokens: a holds 40 (ceil(399 / 10)), b 20, c needs 20: blocked. a
    completes: c fits, and a 100-token d (20 blocks) beside it, a 300-token d (40) not."""
    kv = KvModel(gpu_blocks=75, block_size=10)
    for d_tokens, alone in ((100, False), (300, True)):
        queue = _decoding_two(8, kv, {"c": 100, "d": d_tokens})
        assert queue.admission_blocked(1.0, COST) and queue.prefill_idle(1.0, COST)
        queue.finished(RequestId("a"), 1.0)
        assert queue.lone_head(1.0, COST) == (RequestId("c") if alone else None)


def test_an_engine_still_prefilling_is_not_prefill_idle() -> None:
    queue = _decoding_two(8, None, {"c": 5000})  # c starts at once, 10 steps of 512
    assert not queue.admission_blocked(0.2, COST) and not queue.prefill_idle(0.2, COST)


def test_a_snapshot_keeps_the_pinned_share_of_a_credit_and_an_older_one_reads_as_all() -> None:
    """The blocks a request's unheld credit takes survive a snapshot: the restored queue
    predicts what the original does; a snapshot written before the field existed
    restores every credited block as shared."""
    import msgspec

    from foretoken.core.queue import worker_queue as wq
    from foretoken.core.queue.scheduler import NewRequest

    kv = KvModel(gpu_blocks=64, block_size=16)
    settings_ = SchedulerSettings(max_num_batched_tokens=512, max_num_seqs=4)
    charged, shared = WorkerQueue(settings_, kv=kv), WorkerQueue(settings_, kv=kv)
    charged.add(RequestId("a"), 0.0, 612, 512, 128, pinned_tokens=0)  # 47 blocks
    shared.add(RequestId("a"), 0.0, 612, 512, 128)  # 15 blocks
    new = NewRequest(600, 0, 128)  # 46 blocks: fits only beside the shared one
    want = charged.predict(new, 0.0, COST)
    assert want.ttft_s > shared.predict(new, 0.0, COST).ttft_s + 0.05
    restored = WorkerQueue.restore(charged.snapshot(), kv=kv)
    assert restored.predict(new, 0.0, COST) == want
    state = msgspec.msgpack.decode(charged.snapshot())
    state[2] = [row[:-1] for row in state[2]]  # as written before pinned_tokens
    legacy = WorkerQueue.restore(msgspec.msgpack.encode(state), kv=kv)
    assert legacy.predict(new, 0.0, COST) == shared.predict(new, 0.0, COST)
    assert wq.OutstandingState.__struct_fields__[-1] == "pinned_tokens"
