"""The native recorded future (core/queue/native_walk.py, native/src/queue/) against the
Python reference (core/queue/future.py over core/queue/scheduler.py): on random queues and
costs, the recorded stretches, the end and drain times and every new request's prediction
are *equal* — not approximately: the port computes the same floating-point operations in
the same order.

When these tests are skipped ("the native walk is off"), the Python queue model gained
something (a setting, a cost term, a sequence or scheduler field) that native/src/queue/
does not know (``native_walk.python_model() != native_walk.PORTED``): every walk has fallen
back to the Python reference (answers unchanged, the route path slower; ``foretoken bench
route`` reports ``native_walk: false``). Port the change to native/src/queue/, then update
``native_walk.PORTED``."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given

from foretoken.core.cost.fit import PrefillCurve, StepCost
from foretoken.core.queue import native_walk
from foretoken.core.queue.future import Future
from foretoken.core.queue.inflight import InFlightEstimate
from foretoken.core.queue.native_walk import NativeFuture
from foretoken.core.queue.scheduler import (
    CurveStepCost,
    KvModel,
    NewRequest,
    QueuePrediction,
    _Scheduler,
    _scheduler_from,
)
from foretoken.core.queue.worker_queue import WorkerQueue
from foretoken.core.routing.predict import _quadratic, _step_cost
from foretoken.core.types import RequestId, SchedulerSettings
from tests.unit.core.queue.test_scheduler import NOW, sched
from tests.unit.core.queue.test_scheduler_properties import PROPERTY, settings_st, state_st

pytestmark = pytest.mark.skipif(
    not native_walk.MODELED, reason="the native walk is off (see the module docstring)"
)


def _coefficient(values: list[float], high: float) -> st.SearchStrategy[float]:
    """A few round values and any float of the range (the fits give arbitrary ones; not
    below 1e-12 s, where the Python estimate's decode-only stretches run to 10^266 steps)."""
    return st.sampled_from(values) | st.floats(1e-12, high)


# The fitted curves' shape: C(N) = N·(a + b·N) (PrefillCurve.cost_s), as the route path has it.
quadratic_st = st.builds(
    lambda a, b, overhead, decode: (a, b, overhead, decode),
    _coefficient([0.0, 1e-4, 1e-3, 3.3e-5, 1.234567e-4], 1e-2),
    _coefficient([0.0, 1e-7, 1e-5, 2.5e-9, 7.77e-11], 1e-4),
    _coefficient([0.0, 1e-3, 0.02, 0.0043], 0.1),
    _coefficient([0.0, 1e-4, 3e-3, 1.7e-4], 1e-2),
)
# The engine's KV model (or none): small capacities, so that admission waits for blocks.
kv_st = st.none() | st.builds(KvModel, gpu_blocks=st.integers(1, 40), block_size=st.integers(1, 16))
pinned_st = st.integers(-1, 200)  # of the cached tokens, held by another sequence (-1: all)
news_st = st.lists(
    st.builds(NewRequest, st.integers(1, 200), st.integers(0, 200), st.integers(1, 64), pinned_st),
    min_size=1,
    max_size=4,
)
later_st = st.lists(
    st.sampled_from([-1.0, 0.0, 0.1, 0.3, 2.0, 50.0]) | st.floats(-5.0, 100.0),
    min_size=1,
    max_size=3,
)


def costs(q: tuple[float, float, float, float]) -> tuple[CurveStepCost, CurveStepCost]:
    """The same cost twice: as the Python walk sees it, and marked for the native one."""
    curve = PrefillCurve(q[0], q[1], samples=0, version=0, default=False)
    return (
        CurveStepCost(curve.cost_s, q[2], q[3]),
        CurveStepCost(curve.cost_s, q[2], q[3], (q[0], q[1])),
    )


def native_from_scheduler(
    scheduler: _Scheduler, settings: SchedulerSettings, cost: CurveStepCost, now_s: float,
    tokens_ahead: int,
) -> NativeFuture:  # fmt: skip
    """A replay scheduler (``_scheduler_from``'s) handed over to the native record as it is."""
    prefilling = [(s.computed, s.end, s.left, s.order, s.blocks) for s in scheduler.prefilling]
    running = zip(scheduler.dec_orders, scheduler.dec_done, scheduler.dec_seqs, strict=True)
    decoders = [(order, done, seq.blocks) for order, done, seq in running]
    waiting = [(s.computed, s.end, s.left, s.blocks) for s in scheduler.waiting]
    coefficients = native_walk.coefficients(cost)
    assert coefficients is not None
    return NativeFuture.record(
        settings, cost, coefficients, scheduler.kv, free_at_s=scheduler.free_at_s,
        steps=scheduler.steps, next_order=scheduler.next_order, prefilling=prefilling,
        decoders=decoders, waiting=waiting, now_s=now_s, tokens_ahead=tokens_ahead,
        kv_used=scheduler.kv_used,
    )  # fmt: skip


def assert_same(python: Future, native: NativeFuture, news: list[NewRequest], later: list[float]):
    assert native.stretches == python.stretches
    assert (native.ready_s, native.start_s, native.end_s, native.drained_s) == (
        python.ready_s, python.start_s, python.end_s, python.drained_s,
    )  # fmt: skip
    for now_s in (python.start_s + d for d in later):
        for new in news:
            assert native.first_token(new, now_s) == python.first_token(new, now_s)
        assert native.drain_s(now_s) == python.drain_s(now_s)


@PROPERTY
@given(settings_st, state_st(), news_st, quadratic_st, later_st, kv_st)
def test_the_native_replay_and_walk_equal_the_python_ones(settings_, state, news, q, later, kv):
    reference, marked = costs(q)
    ahead = state.prefill_tokens_left
    python = Future.record(_scheduler_from(settings_, state, kv), settings_, NOW, reference, ahead)
    native = native_from_scheduler(_scheduler_from(settings_, state, kv), settings_, marked, NOW,
                                   ahead)  # fmt: skip
    assert native.kv == python.kv
    assert_same(python, native, news, later)


@PROPERTY
@given(settings_st, state_st(), news_st, quadratic_st, later_st, kv_st)
def test_the_native_walk_of_python_stretches_equals_the_python_walk(
    settings_, state, news, q, later, kv
) -> None:
    reference, marked = costs(q)
    ahead = state.prefill_tokens_left
    python = Future.record(_scheduler_from(settings_, state, kv), settings_, NOW, reference, ahead)
    coefficients = native_walk.coefficients(marked)
    assert coefficients is not None
    native = NativeFuture.from_stretches(
        settings_, marked, coefficients, kv, ready_s=python.ready_s, start_s=python.start_s,
        stretches=python.stretches, end_s=python.end_s, drained_s=python.drained_s,
        tokens_ahead=python.tokens_ahead,
    )  # fmt: skip
    assert_same(python, native, news, later)


class _Tail:
    """An answer whose length is a distribution (core/queue/tails.py): what is left
    depends on what was produced."""

    def left(self, produced: int, u: float) -> int:
        return 1 + (produced * 7) % 13 + int(10 * u)


TAIL = _Tail()


@PROPERTY
@given(settings_st, quadratic_st, st.integers(0, 2**32), news_st, kv_st,
       st.sampled_from([0.0, 0.005, 0.05, 1.0]))  # fmt: skip
def test_an_in_flight_estimate_records_the_same_future_either_way(
    settings_, q, seed, news, kv, lag_s
) -> None:
    """The estimate's own hand-over (arrivals, first tokens before and after the estimate
    got there, removals, time passing, KV blocks, the first tokens' grace ``lag_s``) gives
    the native replay what the Python one gets."""
    reference, marked = costs(q)
    rng = random.Random(seed)
    estimate = InFlightEstimate(settings_, kv)
    estimate.lag_s = lag_s
    now = NOW
    keys: list[int] = []
    for step in range(rng.randint(1, 12)):
        now += rng.choice([0.0, 0.001, 0.01, 0.2])
        estimate.advance(now, reference)
        roll = rng.random()
        if roll < 0.55 or not keys:
            estimate.arrive(step, now, rng.randint(1, 150), rng.randint(0, 40), rng.randint(1, 8),
                            rng.randint(-1, 40), rng.choice([None, TAIL]))  # fmt: skip
            keys.append(step)
        elif roll < 0.8:
            estimate.first_token(rng.choice(keys), now)
        else:
            estimate.remove(keys.pop(rng.randrange(len(keys))))
    scheduler, tokens_ahead = estimate._replay_copy(now)
    python = Future.record(scheduler, settings_, now, reference, tokens_ahead)
    native = estimate.future(now, marked)
    assert isinstance(native, NativeFuture)
    assert native.tokens_ahead == python.tokens_ahead
    assert_same(python, native, news, [0.0, 0.5])


def test_only_a_cost_marked_quadratic_goes_native() -> None:
    reference, marked = costs((1e-4, 1e-8, 0.01, 1e-4))
    estimate = InFlightEstimate(sched(budget=64, seqs=4))
    estimate.arrive("a", NOW, 500, 0, 8)
    assert isinstance(estimate.future(NOW, reference), Future)
    assert isinstance(estimate.future(NOW, marked), NativeFuture)
    lam = CurveStepCost(lambda n: 1e-4 * n, 0.01, 1e-4)
    assert native_walk.coefficients(lam) is None


def test_the_port_models_the_python_queue_model() -> None:
    assert native_walk.python_model() == native_walk.PORTED


def test_a_queue_model_the_port_does_not_know_is_walked_in_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, marked = costs((1e-4, 1e-8, 0.01, 1e-4))
    monkeypatch.setattr(native_walk, "MODELED", False)
    estimate = InFlightEstimate(sched(budget=64, seqs=4))
    estimate.arrive("a", NOW, 500, 0, 8)
    assert isinstance(estimate.future(NOW, marked), Future)


def test_a_fitted_curve_is_marked_quadratic_and_another_curve_is_not() -> None:
    curve = PrefillCurve(1.5e-4, 2.5e-9, samples=10, version=1, default=False)
    assert _quadratic(curve) == (1.5e-4, 2.5e-9)

    class Cubic(PrefillCurve):
        __slots__ = ()

        def cost_s(self, n_tokens: float) -> float:
            return super().cost_s(n_tokens) + 1e-15 * n_tokens**3

    assert _quadratic(Cubic(1.5e-4, 2.5e-9, samples=10, version=1, default=False)) is None


@PROPERTY
@given(settings_st, quadratic_st, st.integers(0, 2**32), kv_st)
def test_a_worker_queue_predicts_the_same_either_way(settings_, q, seed, kv) -> None:
    """The route path's seam: a worker queue fed sends, first tokens, completions and
    expiries predicts and drains the same with the fitted curve's cost walked natively
    and in Python."""
    curve = PrefillCurve(q[0], q[1], samples=10, version=1, default=False)
    cost = _step_cost(curve, StepCost(q[2], q[3], samples=10, version=1, default=False))
    assert cost.quadratic is not None
    rng = random.Random(seed)
    native, python = WorkerQueue(settings_, kv=kv), WorkerQueue(settings_, kv=kv)
    now, sent = NOW, list[RequestId]()
    for step in range(rng.randint(1, 25)):
        now += rng.choice([0.0, 0.001, 0.01, 0.2, 1.0])
        roll = rng.random()
        if roll < 0.5 or not sent:
            rid = RequestId(f"r{step}")
            sizes = (rng.randint(1, 400), rng.randint(0, 100), rng.randint(1, 9),
                     rng.randint(-1, 100))  # fmt: skip
            sent.append(rid)
            tail = rng.choice([None, TAIL])
            for queue in (native, python):
                queue.add(rid, now, *sizes, tail=tail)
        elif roll < 0.75:
            rid = rng.choice(sent)
            for queue in (native, python):
                queue.first_token(rid, now)
        elif roll < 0.95:
            rid = rng.choice(sent)
            for queue in (native, python):
                queue.finished(rid, now)
        else:
            for queue in (native, python):
                queue.expire(now, 0.5)
        new = NewRequest(rng.randint(1, 500), rng.randint(0, 300), rng.randint(1, 64),
                         rng.randint(-1, 300))  # fmt: skip
        want = _python_walk(python, new, now, cost)
        assert (native.predict(new, now, cost), native.drain_s(now, cost)) == want


def _python_walk(
    queue: WorkerQueue, new: NewRequest, now: float, cost: CurveStepCost
) -> tuple[QueuePrediction, float]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_walk, "MODELED", False)
        return queue.predict(new, now, cost), queue.drain_s(now, cost)
