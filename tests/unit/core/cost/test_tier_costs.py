"""A lower tier's load cost: the configured prior, moved by the worker's own samples."""

from __future__ import annotations

import pytest

from foretoken.core.cost.tier_costs import TierCosts
from foretoken.core.types import WorkerId

W, V = WorkerId("w"), WorkerId("v")


def test_the_prior_answers_until_samples_come_and_then_they_take_over() -> None:
    costs = TierCosts({"CPU": 2e-6, "DISK": 1e-5}, prior_weight=4.0, window=64)
    assert costs.cost(W, "CPU") == 2e-6 and costs.cost(W, "SHARED") == 0.0
    costs.observe(W, "CPU", 5e-7)
    assert costs.cost(W, "CPU") == pytest.approx((4 * 2e-6 + 5e-7) / 5)
    for _ in range(60):
        costs.observe(W, "CPU", 5e-7)
    assert costs.cost(W, "CPU") == pytest.approx((4 * 2e-6 + 61 * 5e-7) / 65)
    assert costs.cost(V, "CPU") == 2e-6 and costs.cost(W, "DISK") == 1e-5  # per worker, tier


def test_outliers_barely_move_it_and_bad_samples_are_ignored() -> None:
    costs = TierCosts({"CPU": 2e-6}, prior_weight=4.0)
    for _ in range(20):
        costs.observe(W, "CPU", 1e-6)
    costs.observe(W, "CPU", 1e-3)  # a stall: one sample of a median
    assert costs.cost(W, "CPU") == pytest.approx((4 * 2e-6 + 21 * 1e-6) / 25)
    assert not costs.observe(W, "CPU", float("nan"))
    assert not costs.observe(W, "GPU", 1e-6)  # not a lower tier with a prior
    costs.observe(W, "CPU", -1.0)  # faster than its own prefill: counted as free
    assert costs.samples(W, "CPU") == 22


def test_a_removed_worker_is_back_on_the_prior() -> None:
    costs = TierCosts({"CPU": 2e-6})
    costs.observe(W, "CPU", 1e-7)
    costs.forget_worker(W)
    assert costs.cost(W, "CPU") == 2e-6 and costs.describe(W)["CPU"]["samples"] == 0
