"""How late first tokens reach the route service (``RouteService.lag_s``): the 90th
percentile of the last 64, capped, handed to every queue model — a new worker's too — as the
grace before an unconfirmed prefill is overdue (``InFlightEstimate.lag_s``)."""

from __future__ import annotations

import pytest

from foretoken.wire.records import Outcome
from tests.unit.core.routing.test_service import _predictor, _reg


def _first_token(rid: str, ts: float) -> Outcome:
    return Outcome(request_id=rid, ts=ts, kind="first_token", worker_id="w0", actual_ttft_s=0.1)  # type: ignore[arg-type]


def test_the_lag_is_the_90th_percentile_of_recent_first_tokens_and_reaches_every_queue() -> None:
    p = _predictor(2)
    for k in range(15):
        p.on_outcome(_first_token(f"r{k}", 10.0 + k), 10.0 + k + 0.02)
    assert p.lag_s == 0.0  # taken every 16 first tokens
    p.on_outcome(_first_token("r15", 30.0), 30.5)  # one slow delivery among 16
    assert p.lag_s == pytest.approx(0.02)
    assert all(q.lag_s == pytest.approx(0.02) for q in p.book.queues.values())
    p.on_registration(_reg("w9"))
    assert p.book.queues["w9"].lag_s == pytest.approx(0.02)  # a new worker starts with it


def test_a_broker_stall_does_not_make_every_prefill_look_done() -> None:
    p = _predictor(1, max_first_token_lag_s=0.25)
    for k in range(16):
        p.on_outcome(_first_token(f"r{k}", float(k)), float(k) + 30.0)  # 30 s late each
    assert p.lag_s == 0.25
