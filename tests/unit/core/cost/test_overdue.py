"""A cold worker whose requests wait past their predictions is priced slower (cost.overdue),
and a prior curve is scaled to a worker's first samples before it has a fit of its own."""

from __future__ import annotations

import pytest

from foretoken.core.cost.fit import DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S_PER_TOKEN2, OnlinePrefillFit
from foretoken.core.cost.overdue import Overdue, OverdueConfig
from foretoken.core.types import RequestId, WorkerId
from tests.unit.core.routing.test_service import _predictor, _req

W = WorkerId("w")


def test_the_factor_is_the_worst_overdue_ratio_times_the_margin() -> None:
    o = Overdue(OverdueConfig(margin=1.5, max_scale=16.0, max_age_s=100.0))
    o.sent(RequestId("a"), W, 0.0, 0.2)
    o.sent(RequestId("b"), W, 0.0, 1.0)
    assert o.factor(W, 0.4) == 1.0  # no grant back yet: maybe never sent (a caller that asks)
    o.confirm(RequestId("a"), W)
    o.confirm(RequestId("b"), W)
    assert o.factor(W, 0.1) == 1.0  # nothing overdue yet
    assert o.factor(W, 0.4) == pytest.approx(2.0 * 1.5)  # a: 0.4 s against 0.2 s
    assert o.factor(WorkerId("other"), 0.4) == 1.0
    o.done(RequestId("a"))  # its first token came
    assert o.factor(W, 0.4) == 1.0 and len(o) == 1
    assert o.factor(W, 50.0) == 16.0  # capped
    assert o.factor(W, 200.0) == 1.0 and len(o) == 0  # waited past max_age: forgotten
    o.sent(RequestId("c"), W, 0.0, 0.0)  # a zero prediction counts as floor_s
    o.confirm(RequestId("c"), W)
    assert o.factor(W, 0.1) == pytest.approx(0.1 / 0.05 * 1.5)
    o.sent(RequestId("d"), W, 0.0, 0.01)
    o.confirm(RequestId("d"), WorkerId("elsewhere"))  # its grant went to another worker
    assert RequestId("d") not in o._where
    o.forget_worker(W)
    assert len(o) == 0


def test_a_cold_worker_whose_request_is_overdue_is_predicted_slower() -> None:
    """Only once its grant came back: a caller that only asks is no evidence (below)."""
    p = _predictor(1)
    first = p.route(_req("r1", 4096).query(), 0.0, 0.0)
    p.on_grant(first, 0.0)  # the router sent it
    assert first.admitted and first.fit is not None and first.fit.default
    assert first.predicted_ttft_s is not None
    later = first.predicted_ttft_s * 4  # r1 still without a first token at 4x its prediction
    slow = p.predict(first.model, tuple(range(10_000, 14_096)), later, 4096)[0]
    off = _predictor(1, overdue_scale=False)
    off.on_grant(off.route(_req("r1", 4096).query(), 0.0, 0.0), 0.0)
    plain = off.predict(first.model, tuple(range(10_000, 14_096)), later, 4096)[0]
    assert slow.prediction.prefill_s > 4 * plain.prediction.prefill_s
    assert slow.prediction.queue_wait_s > plain.prediction.queue_wait_s  # r1 is still ahead


def test_a_prior_is_scaled_to_the_first_samples() -> None:
    fit = OnlinePrefillFit()
    assert fit.scaled(1e-5, 1e-10) is None  # no sample: nothing to scale to
    a, b = DEFAULT_A_S_PER_TOKEN, DEFAULT_B_S_PER_TOKEN2
    for n in (1000, 1200, 900):  # three samples 3x the default: no fit yet (min_samples)
        fit.observe(n, 3 * (a * n + b * n * n), 0.0)
    assert fit.curve.default
    scaled = fit.scaled(a, b)
    assert scaled is not None
    assert scaled[0] == pytest.approx(3 * a) and scaled[1] == pytest.approx(3 * b)
    big = OnlinePrefillFit()
    big.observe(1000, 1e6, 0.0)
    top = big.config.prior_scale_max
    assert big.scaled(a, b) == pytest.approx((a * top, b * top))  # clamped


def test_decisions_nobody_sent_leave_a_cold_worker_as_it_was() -> None:
    p, q = _predictor(1), _predictor(1, overdue_scale=False)
    for svc in (p, q):
        for i in range(5):  # route calls with no traffic behind them: no grant comes back
            svc.route(_req(f"ask{i}", 4096).query(), 0.0, 0.0)
    later = [svc.predict("m", tuple(range(10_000, 14_096)), 30.0, 4096)[0] for svc in (p, q)]
    assert later[0].prediction.prefill_s == later[1].prediction.prefill_s
