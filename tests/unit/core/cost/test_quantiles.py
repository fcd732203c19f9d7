"""Calibrated upper quantiles of TTFT (foretoken.core.cost.quantiles): coverage on a
stationary stream, regimes kept apart, the fleet's pool and the default before either has
enough, one residual per request."""

from __future__ import annotations

import numpy as np
import pytest

from foretoken.core.cost.quantiles import QuantileConfig, TtftQuantiles
from foretoken.core.types import RequestId, WorkerId

W1, W2 = WorkerId("w1"), WorkerId("w2")


def _stream(q: TtftQuantiles, rng: np.random.Generator, n: int, sigma: float,
            worker: WorkerId = W1, queued: bool = True, start: int = 0) -> float:  # fmt: skip
    """Predictions of random size, actual = predicted·lognormal(0.1, sigma); each p90 is
    read before its residual is observed. Returns the coverage."""
    hits = 0
    for i in range(n):
        predicted = float(rng.uniform(0.2, 20.0))
        actual = predicted * float(rng.lognormal(0.1, sigma))
        wait = 1.0 if queued else 0.0
        upper = q.upper(worker, predicted, 0.9, wait, False)
        hits += actual <= upper
        q.observe(RequestId(f"{worker}-{start + i}"), worker, predicted, actual, wait, False)
    return hits / n


def test_a_stationary_stream_is_covered_at_its_level() -> None:
    rng = np.random.default_rng(1)
    q = TtftQuantiles()
    _stream(q, rng, 200, 0.3)  # warm-up
    assert _stream(q, rng, 3000, 0.3, start=200) == pytest.approx(0.9, abs=0.025)


def test_regimes_do_not_mix_and_a_new_worker_borrows_the_pool() -> None:
    rng = np.random.default_rng(2)
    q = TtftQuantiles()
    _stream(q, rng, 400, 0.05, queued=False)  # idle: tight errors
    _stream(q, rng, 400, 0.8, queued=True, start=400)  # queued: wide errors
    tight = q.upper(W1, 10.0, 0.9, 0.0, False)
    wide = q.upper(W1, 10.0, 0.9, 1.0, False)
    assert 10.0 < tight < 13.0 < wide
    assert q.upper(W2, 10.0, 0.9, 1.0, False) == pytest.approx(wide, rel=0.1)  # the pool


def test_without_residuals_the_default_factor_applies() -> None:
    cfg = QuantileConfig(default_factor=2.0, floor_s=0.1, min_samples=30)
    q = TtftQuantiles(cfg)
    assert q.upper(W1, 4.9, 0.9, 1.0, True) == pytest.approx(2 * 5.0 - 0.1)
    for i in range(29):
        q.observe(RequestId(f"r{i}"), W1, 1.0, 1.0, 1.0, True)
    assert q.upper(W1, 4.9, 0.9, 1.0, True) == pytest.approx(9.9)  # 29 < min_samples
    q.observe(RequestId("r29"), W1, 1.0, 1.0, 1.0, True)
    assert q.upper(W1, 4.9, 0.9, 1.0, True) == pytest.approx(4.9)  # residuals all 0


def test_one_request_is_one_residual_and_bad_values_are_ignored() -> None:
    q = TtftQuantiles()
    assert q.observe(RequestId("a"), W1, 1.0, 2.0, 0.0, False)
    assert not q.observe(RequestId("a"), W1, 1.0, 2.0, 0.0, False)
    assert not q.observe(RequestId("b"), W1, float("nan"), 2.0, 0.0, False)
    assert not q.observe(RequestId("c"), W1, 1.0, -1.0, 0.0, False)
    assert q.observed == 1


def test_a_removed_worker_forgets_its_own_residuals() -> None:
    rng = np.random.default_rng(3)
    q = TtftQuantiles()
    _stream(q, rng, 100, 0.3)
    q.forget(W1)
    assert q.upper(W1, 10.0, 0.9, 1.0, False) == pytest.approx(q.upper(W2, 10.0, 0.9, 1.0, False))


def _censored_scene(censored: bool) -> tuple[float, float]:
    """A queue that grows: the requests that came back were over-predicted (actual =
    0.8·predicted); forty sent later are still waiting, each already past its prediction.
    Returns the p90 upper bound of a 10 s prediction, with and without ``now_s``."""
    q = TtftQuantiles(QuantileConfig(censored=censored))
    for i in range(40):
        q.sent(RequestId(f"done-{i}"), W1, 1.0, 1.0, False, now_s=0.0)
        q.observe(RequestId(f"done-{i}"), W1, 1.0, 0.8, 1.0, False)
    for i in range(40):  # predicted 1 s at t = 1, still waiting at t = 4
        q.sent(RequestId(f"slow-{i}"), W1, 1.0, 1.0, False, now_s=1.0)
    return q.upper(W1, 10.0, 0.9, 1.0, False, now_s=4.0), q.upper(W1, 10.0, 0.9, 1.0, False)


def test_requests_still_waiting_past_the_quantile_raise_it() -> None:
    with_now, without_now = _censored_scene(censored=True)
    assert without_now == pytest.approx(10.1 * 0.9 / 1.1 - 0.1)  # the finished ones alone
    # at least log(3.1 / 1.1) each: half the window is above, so the p90 is one of them
    assert with_now == pytest.approx(10.1 * 3.1 / 1.1 - 0.1)
    off, _ = _censored_scene(censored=False)
    assert off == pytest.approx(without_now)


def test_waiting_requests_that_end_or_are_dropped_stop_counting() -> None:
    q = TtftQuantiles()
    for i in range(40):
        q.observe(RequestId(f"done-{i}"), W1, 1.0, 0.8, 1.0, False)
    for i in range(40):
        q.sent(RequestId(f"slow-{i}"), W1, 1.0, 1.0, False, now_s=1.0)
    high = q.upper(W1, 10.0, 0.9, 1.0, False, now_s=4.0)
    for i in range(40):
        q.drop(RequestId(f"slow-{i}"))  # failed or withdrawn: no residual will come
    assert q.upper(W1, 10.0, 0.9, 1.0, False, now_s=4.1) < high
    q.sent(RequestId("late"), W1, 1.0, 1.0, False, now_s=1.0)
    q.observe(RequestId("late"), W1, 1.0, 1.2, 1.0, False)  # its residual replaces its bound
    q.sent(RequestId("late"), W1, 1.0, 1.0, False, now_s=5.0)  # seen: not waiting again
    assert q.upper(W1, 10.0, 0.9, 1.0, False, now_s=9.0) < high
    stale = TtftQuantiles(QuantileConfig(pending_max_s=2.0))
    for i in range(40):
        stale.observe(RequestId(f"done-{i}"), W1, 1.0, 0.8, 1.0, False)
        stale.sent(RequestId(f"lost-{i}"), W1, 1.0, 1.0, False, now_s=0.0)
    base = stale.upper(W1, 10.0, 0.9, 1.0, False)
    assert stale.upper(W1, 10.0, 0.9, 1.0, False, now_s=5.0) == pytest.approx(base)
