"""The queue-wait scale: learned from first tokens, only lengthens, bounded, shrunk to 1."""

from __future__ import annotations

import math

import pytest

from foretoken.core.cost.wait_scale import WaitScale, WaitScaleConfig
from foretoken.core.types import RequestId, WorkerId

W, V = WorkerId("w"), WorkerId("v")


def _feed(scale: WaitScale, wid: WorkerId, ratio: float, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        rid = RequestId(f"{wid}-{i}")
        scale.decided(rid, wid, 1.0, 0.2)  # 1 s of predicted wait over 0.2 s of prefill
        scale.first_token(rid, wid, 0.2 + ratio)


def test_waits_longer_than_predicted_lengthen_that_workers_predictions_only() -> None:
    scale = WaitScale(WaitScaleConfig(window=32, prior=16.0, max_scale=2.0))
    _feed(scale, W, 1.5, 32)
    assert scale.factor(W) == pytest.approx(math.exp(math.log(1.5) * 32 / 48))
    assert scale.factor(V) == 1.0


def test_shorter_waits_never_shorten_and_the_scale_is_bounded() -> None:
    scale = WaitScale(WaitScaleConfig(window=8, prior=0.0, max_scale=2.0))
    _feed(scale, W, 0.5, 8)
    assert scale.factor(W) == 1.0
    _feed(scale, W, 5.0, 8, start=8)  # the window rolls: only the long waits are left
    assert scale.factor(W) == 2.0


def test_short_predicted_waits_and_unknown_requests_teach_nothing() -> None:
    scale = WaitScale(WaitScaleConfig(min_wait_s=0.3, prior=0.0))
    scale.decided(RequestId("short"), W, 0.1, 0.2)
    scale.first_token(RequestId("short"), W, 5.0)
    scale.first_token(RequestId("never-decided"), W, 5.0)
    scale.decided(RequestId("moved"), W, 1.0, 0.2)
    scale.first_token(RequestId("moved"), V, 5.0)  # served elsewhere: not this prediction
    scale.decided(RequestId("failed"), W, 1.0, 0.2)
    scale.forget(RequestId("failed"))
    scale.first_token(RequestId("failed"), W, 5.0)
    assert scale.factor(W) == 1.0 and scale.factor(V) == 1.0


def test_a_removed_worker_starts_again_at_one() -> None:
    scale = WaitScale(WaitScaleConfig(prior=0.0))
    _feed(scale, W, 1.8, 10)
    assert scale.factor(W) > 1.5
    scale.forget_worker(W)
    assert scale.factor(W) == 1.0


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        WaitScaleConfig(max_scale=0.9)


def test_the_scale_adds_no_more_than_the_largest_shortfall_it_learned_from() -> None:
    # a burst's shallow waits (1 s predicted) came out 1.5 s: the factor says 1.5, and it
    # says so of a wait of 6 s only up to the 0.5 s those waits fell short by
    scale = WaitScale(WaitScaleConfig(window=8, prior=0.0, max_scale=2.0))
    _feed(scale, W, 1.5, 8)
    assert scale.factor(W) == pytest.approx(1.5)
    assert scale.scaled(W, 0.5) == pytest.approx(0.75)
    assert scale.scaled(W, 1.0) == pytest.approx(1.5)
    assert scale.scaled(W, 6.0) == pytest.approx(6.5)
    for raw in (0.0, 0.5, 1.0, 6.0):  # and the raw wait is read back from a scaled one
        assert scale.raw(W, scale.scaled(W, raw)) == pytest.approx(raw)
    assert scale.scaled(V, 6.0) == 6.0 and scale.raw(V, 6.0) == 6.0
    scale.forget_worker(W)
    assert scale.scaled(W, 6.0) == 6.0
