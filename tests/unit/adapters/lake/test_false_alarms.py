"""False-alarm estimators (grading/false_alarms.py and the ``false_alarms`` view) on
synthetic data with a known answer.

The synthetic world: log actual = log predicted + σ·ε, ε standard normal, σ = 0.5 — so for
a request predicted p with bound B, P(actual ≤ B) = Φ((log B − log p)/σ). Served
requests have log p ~ N(0.5, 1); rejected ones (and the explore admissions, drawn from the
same would-be rejections) log p ~ N(2, 0.6), with B = 5 or 10 s.
"""

from __future__ import annotations

from pathlib import Path
from statistics import NormalDist

import numpy as np
import polars as pl
import pytest

from foretoken.adapters.lake.false_alarms import (
    MIN_FIT_ROWS,
    estimate,
    fit_quantiles,
    midpoint_grid,
    model_based,
    wilson_interval,
)
from foretoken.adapters.lake.views import connect
from foretoken.adapters.lake.writer import LakeWriter, graded_schema

SIGMA = 0.5
BOUNDS = np.array([5.0, 10.0])
PHI = np.vectorize(NormalDist().cdf)


def world(seed: int, served: int = 3000, rejected: int = 800) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x_served = rng.normal(0.5, 1.0, served)
    x_rejected = rng.normal(2.0, 0.6, rejected)
    bound = rng.choice(BOUNDS, rejected)
    return {
        "served_predicted": np.exp(x_served),
        "served_actual": np.exp(x_served + SIGMA * rng.standard_normal(served)),
        "rejected_predicted": np.exp(x_rejected),
        "rejected_bound": bound,
        # What would have happened to the rejected ones (never seen by the estimators).
        "rejected_actual": np.exp(x_rejected + SIGMA * rng.standard_normal(rejected)),
        "truth": PHI((np.log(bound) - x_rejected) / SIGMA),
    }


def test_quantreg_recovers_the_conditional_quantile_lines() -> None:
    w = world(1, served=4000)
    fit = fit_quantiles(np.log(w["served_predicted"]), np.log(w["served_actual"]), grid=10)
    expected = np.array([NormalDist().inv_cdf(t) * SIGMA for t in midpoint_grid(10)])
    assert np.allclose(fit.slopes, 1.0, atol=0.06)
    assert np.allclose(fit.intercepts, expected, atol=0.06)
    # P(actual ≤ B | p) at log p = log B is the share of lines below 0: one half.
    assert fit.cdf(np.array([1.0]), np.array([1.0]))[0] == pytest.approx(0.5, abs=0.1)


def test_model_based_estimate_covers_the_known_answer() -> None:
    w = world(2)
    estimates = model_based(
        w["served_predicted"], w["served_actual"], w["rejected_predicted"], w["rejected_bound"]
    )
    assert [e.bound_s for e in estimates] == [5.0, 10.0]
    for e in estimates:
        mine = w["rejected_bound"] == e.bound_s
        expected = float(w["truth"][mine].sum())
        realized = int((w["rejected_actual"][mine] <= e.bound_s).sum())
        assert e.rejected == e.estimable == int(mine.sum())
        assert e.lo is not None and e.hi is not None and e.estimated_false_alarms is not None
        assert e.lo <= expected <= e.hi
        assert e.lo <= realized <= e.hi
        assert e.fit_sd is not None and e.fit_sd > 0 and e.outcome_sd is not None
        # Within a few fit standard deviations of the expectation: the fit is unbiased.
        assert abs(e.estimated_false_alarms - expected) < 4 * e.fit_sd + 0.02 * e.rejected
        assert e.rate == pytest.approx(e.estimated_false_alarms / e.estimable)


def test_unusable_inputs_are_counted_but_not_estimated() -> None:
    w = world(3, served=MIN_FIT_ROWS - 1, rejected=10)
    predicted = w["rejected_predicted"].copy()
    predicted[:3] = np.nan
    (only,) = model_based(w["served_predicted"], w["served_actual"], predicted, np.full(10, 5.0))
    assert (only.rejected, only.estimable) == (10, 7)
    assert only.estimated_false_alarms is None and only.lo is None


def test_wilson_interval_known_values() -> None:
    lo, hi = wilson_interval(5, 10) or (0, 0)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    z2 = 1.959963984540054**2
    assert wilson_interval(0, 1) == (0.0, pytest.approx(z2 / (1 + z2)))
    assert wilson_interval(1, 1) == (pytest.approx(1 / (1 + z2)), 1.0)
    assert wilson_interval(0, 0) is None


def synthetic_lake(root: Path, seed: int) -> dict[float, float]:
    """Served, rejected and explore-admitted requests of the synthetic world, written as
    a lake. Returns, per bound, the true expected false alarms among the rejected."""
    w = world(seed, served=2000, rejected=1200)
    rng = np.random.default_rng(seed + 100)
    explore = rng.random(len(w["rejected_bound"])) < 1 / 3  # admitted anyway
    n_served = len(w["served_predicted"])
    predicted = np.concatenate([w["served_predicted"], w["rejected_predicted"]])
    actual = np.concatenate([w["served_actual"], w["rejected_actual"]])
    is_rejected = np.concatenate([np.zeros(n_served, bool), ~explore])
    bound = np.concatenate([rng.choice([5.0, 10.0, 30.0], n_served), w["rejected_bound"]])
    n = len(predicted)
    frame = pl.DataFrame(
        {
            "request_id": [f"q{i}" for i in range(n)],
            "ts": np.full(n, 1_735_689_600.0),
            "model": ["m"] * n,
            "workload_class": ["default"] * n,
            "worker_id": [None if r else "w0" for r in is_rejected],
            "status": np.where(is_rejected, "rejected", "served"),
            "admitted": ~is_rejected,
            "explore": np.concatenate([np.zeros(n_served, bool), explore]),
            "prompt_tokens": np.full(n, 1000),
            "predicted_ttft_s": predicted,
            "actual_ttft_s": actual,
            "error_s": predicted - actual,
            "max_queue_wait_s": bound,
        }
    )
    filled: dict[str, object] = {k: None for k in graded_schema() if k not in frame.columns}
    filled.update(schema_version=1, fallback=False, credited_cached_tokens=0)
    filled.update(already_waited_s=0.0, queue_tokens_ahead=0, approximate_cache=False)
    LakeWriter(root).append_frame(frame.with_columns(pl.lit(v).alias(k) for k, v in filled.items()))
    truth = w["truth"][~explore]
    return {b: float(truth[w["rejected_bound"][~explore] == b].sum()) for b in (5.0, 10.0)}


def test_both_estimates_from_a_lake_cover_the_truth(tmp_path: Path) -> None:
    truth = synthetic_lake(tmp_path, seed=4)
    with connect(tmp_path) as con:
        result = estimate(con, draws=200)
    model = {row["bound_s"]: row for row in result["model_based"]}
    direct = {row["bound_s"]: row for row in result["direct"]}
    for bound, expected in truth.items():
        m, d = model[bound], direct[bound]
        assert m["lo"] <= expected <= m["hi"]
        assert d["estimated_false_alarms_lo"] <= expected <= d["estimated_false_alarms_hi"]
        # The view's interval is the Wilson interval of the explore counts.
        lo, hi = wilson_interval(d["explore_within"], d["explore_admitted"]) or (0, 0)
        assert (d["within_fraction_lo"], d["within_fraction_hi"]) == (
            pytest.approx(lo), pytest.approx(hi))  # fmt: skip
        assert d["rejected"] == m["rejected"] > 0
    assert result["model_fit_rows"] > MIN_FIT_ROWS and "QuantReg" in result["model_method"]


def test_rejections_no_delay_could_turn_are_no_model_based_false_alarms(tmp_path: Path) -> None:
    """Requests the latency controls shed (or the router's fallback turned away) are counted
    apart by the direct estimate; the model-based one counted them as would-be false alarms
    (and the dashboard said "5 of 0 rejections covered")."""
    from foretoken.adapters.dashboard import data
    from tests.unit.adapters.lake.test_views import rec

    served = [
        rec(
            f"s{i}",
            worker_id="w1",
            predicted_ttft_s=1.0 + 0.01 * i,
            actual_ttft_s=1.0 + 0.012 * i,
            max_queue_wait_s=5.0,
        )
        for i in range(40)
    ]
    shed = [
        rec(
            f"shed{i}",
            status="rejected",
            admitted=False,
            predicted_ttft_s=1.0,
            max_queue_wait_s=5.0,
            reject_reason="admission_control",
        )
        for i in range(5)
    ]
    fallback = rec(
        "fb",
        status="rejected",
        admitted=False,
        fallback=True,
        predicted_ttft_s=1.0,
        max_queue_wait_s=5.0,
        reject_reason="predicted_ttft_exceeds_bound",
    )
    LakeWriter(tmp_path).append([*served, *shed, fallback])
    with connect(tmp_path) as con:
        result = estimate(con, draws=20)
        assert result["model_based"] == []
        (direct,) = result["direct"]
        assert direct["rejected"] == 0 and direct["rejected_not_explored"] == 6
        fa = data.false_alarms(con, data.Filters())
    assert (fa.rejected, fa.covered, fa.distribution_estimate) == (0, 0, None)
