"""The recorded future (predictor/replay_future.py): walking a new request through a
queue's recorded steps gives what a full replay with the request in it gives."""

from __future__ import annotations

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given

from foretoken.core.queue.future import Future
from foretoken.core.queue.inflight import InFlightEstimate
from foretoken.core.queue.scheduler import (
    KvModel,
    NewRequest,
    QueueState,
    SeqState,
    _scheduler_from,
    projected_drain_s,
    simulate_until_first_token,
)
from foretoken.core.types import SchedulerSettings
from tests.unit.core.queue.test_scheduler import COST, NOW, sched
from tests.unit.core.queue.test_scheduler_properties import (
    PROPERTY,
    cost_st,
    new_st,
    settings_st,
    state_st,
)


@PROPERTY
@given(
    settings_st,
    state_st(),
    st.lists(new_st, min_size=1, max_size=4),
    cost_st,
    st.lists(st.sampled_from([0.0, 0.1, 0.3, 2.0, 50.0]), min_size=1, max_size=3),
)
def test_walking_the_recorded_future_equals_a_full_replay(
    settings_, state, news, cost, later
) -> None:
    future = Future.record(
        _scheduler_from(settings_, state), settings_, NOW, cost, state.prefill_tokens_left
    )
    for now_s in (NOW + d for d in later):
        for new in news:
            walked = future.first_token(new, now_s)
            full = simulate_until_first_token(settings_, state, new, now_s, cost)
            assert walked.steps == full.steps
            assert walked.queue_tokens_ahead == full.queue_tokens_ahead
            assert walked.ttft_s == pytest.approx(full.ttft_s, rel=1e-9, abs=1e-12)
            assert walked.queue_wait_s == pytest.approx(full.queue_wait_s, rel=1e-9, abs=1e-12)
        drain = projected_drain_s(settings_, state, now_s, cost)
        assert future.drain_s(now_s) == pytest.approx(drain, rel=1e-9, abs=1e-12)


def test_the_future_is_replayed_again_only_after_a_change() -> None:
    estimate = InFlightEstimate(sched(budget=64, seqs=4))
    estimate.arrive("a", NOW, 500, 0, 8)
    first = estimate.future(NOW + 0.001, COST)
    assert estimate.future(NOW + 0.001, COST) is first  # nothing changed: the same one
    before = estimate.predict(NewRequest(100), NOW + 0.001, COST).ttft_s
    estimate.arrive("b", NOW + 0.001, 400, 0, 8)  # more work ahead
    assert estimate.future(NOW + 0.001, COST) is not first
    after = estimate.predict(NewRequest(100), NOW + 0.001, COST).ttft_s
    assert after > before
    estimate.remove("b")
    assert estimate.predict(NewRequest(100), NOW + 0.001, COST).ttft_s == pytest.approx(before)


def test_a_new_cost_curve_replays_the_future_again() -> None:
    from foretoken.core.queue.scheduler import CurveStepCost

    estimate = InFlightEstimate(sched(budget=64, seqs=4))
    estimate.arrive("a", NOW, 500, 0, 8)
    slow = CurveStepCost(lambda n: 2e-3 * n, 0.01, 1e-3)
    fast_s = estimate.predict(NewRequest(100), NOW, COST).ttft_s
    slow_s = estimate.predict(NewRequest(100), NOW, slow).ttft_s
    assert slow_s > fast_s


kv_st = st.builds(KvModel, st.integers(1, 120), st.sampled_from([1, 4, 16]))


@PROPERTY
@given(
    settings_st,
    state_st(),
    st.lists(new_st, min_size=1, max_size=3),
    cost_st,
    kv_st,
    st.integers(1, 40),
    st.lists(st.sampled_from([0.0, 0.3, 50.0]), min_size=1, max_size=2),
    st.integers(-1, 60),
)
def test_the_walk_stays_exact_when_admission_waits_for_kv_blocks(
    settings_, state, news, cost, kv, output, later, pinned
) -> None:
    """A head whose blocks do not fit waits, with everyone behind it, until running
    sequences leave (its unpinned cached blocks charged too): the walk still gives what
    the full replay gives."""
    future = Future.record(
        _scheduler_from(settings_, state, kv), settings_, NOW, cost, state.prefill_tokens_left
    )
    for now_s in (NOW + d for d in later):
        for new in news:
            new = msgspec.structs.replace(new, output_tokens=output, pinned_tokens=pinned)
            walked = future.first_token(new, now_s)
            full = simulate_until_first_token(settings_, state, new, now_s, cost, kv)
            assert walked.steps == full.steps
            assert walked.ttft_s == pytest.approx(full.ttft_s, rel=1e-9, abs=1e-12)


def test_a_cached_prefix_nobody_holds_takes_blocks_from_the_free_pool() -> None:
    """A prompt whose cached prefix no sequence on the engine holds must take those blocks
    out of the free pool (vLLM charges evictable computed blocks): with one running request
    holding most of the pool it waits for that one to finish, while the same prompt whose
    prefix the running one shares starts beside it."""
    settings_ = SchedulerSettings(max_num_batched_tokens=4096, max_num_seqs=8)
    kv = KvModel(gpu_blocks=100, block_size=16)
    # running: a 1,200-token prompt not yet computed, 80 output tokens: 80 blocks reserved
    state = QueueState(free_at_s=NOW, running=(SeqState(1200, 0, 80),))
    shared = NewRequest(800, 784, 1, pinned_tokens=784)  # 49 cached blocks held: 1 charged
    unheld = NewRequest(800, 784, 1, pinned_tokens=0)  # 50 blocks: does not fit beside it
    started = simulate_until_first_token(settings_, state, shared, NOW, COST, kv)
    waited = simulate_until_first_token(settings_, state, unheld, NOW, COST, kv)
    assert started.steps == 1
    assert waited.steps == 81  # the running one's 80 steps to its last token, then its own
    assert kv.blocks(800, 784, 1) == 1 and kv.blocks(800, 0, 1) == 50
    for new, want in ((shared, started), (unheld, waited)):
        future = Future.record(_scheduler_from(settings_, state, kv), settings_, NOW, COST, 0)
        assert future.first_token(new, NOW).steps == want.steps
