"""False alarms (PRODUCT.md §4), estimated two ways.

A false alarm is a rejected request that would have been served within its bound B. A
rejected request never gets a TTFT, so the count is estimated:

**(a) Model-based**, from served requests: the conditional distribution of the actual TTFT
given the predicted one. statsmodels ``QuantReg`` of ``log actual`` on ``[1, log
predicted]`` is fitted at a grid of K quantiles τ_k = (k + ½)/K (midpoints; default K = 20)
on the served requests (a random sample of at most ``fit_rows``). For a rejected request
with prediction p and bound B,

    P(actual ≤ B | p) ≈ (1/K) · #{k : α_k + β_k·log p ≤ log B}

which is the CDF of the *rearranged* quantile curves (counting does not care about
quantile crossing). The estimated false alarms at B are the sum over the rejected
requests with that bound.

Its 95% interval is ``estimate ± 1.96·sd``, clipped to [0, rejected], with two parts of
the variance:

* the fit: the QuantReg coefficients of the whole grid are jointly asymptotically normal;
  under iid errors (a location shift in log space) Cov(θ_j, θ_k) = (min(τ_j, τ_k) −
  τ_j·τ_k)·s_j·s_k·(X'X)⁻¹ with s the sparsity QuantReg reports (Koenker 2005, §4.2).
  ``draws`` coefficient grids are drawn from that normal and the sum re-evaluated for each
  (on a sample of at most ``draw_rows`` rejected requests, scaled up per bound) — a
  parametric bootstrap that costs K fits instead of K per replicate;
* the outcomes: given their probabilities, whether each rejected request would have made
  it is a coin flip, Σ P·(1 − P).

Served requests are mostly those predicted within their bound and rejected ones those
predicted over it, so (a) extrapolates along the predicted axis; (b) is the check.

**(b) Direct**, from explore admissions (a small random fraction of would-be rejections
admitted anyway): the fraction served within B, with a Wilson score interval, times the
rejected count. The SQL view ``false_alarms`` computes it; :func:`wilson_interval` is the
same formula for Python callers.

Everything is vectorized with numpy over the requests; the loops run over the quantile
grid and the draws.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Final

import duckdb
import numpy as np
from statsmodels.regression.quantile_regression import QuantReg

from foretoken.adapters.lake.views import query, rows

Z95: Final = 1.959963984540054  # the standard normal's 97.5% point
GRID: Final = 20
FIT_ROWS: Final = 5000
DRAWS: Final = 400
DRAW_ROWS: Final = 5000
MIN_FIT_ROWS: Final = 30
SEED: Final = 0
METHOD: Final = (
    "QuantReg of log actual on log predicted at τ = (k+½)/K; P(actual ≤ B | predicted) from "
    "the rearranged quantile curves; interval: parametric draws from the joint asymptotic "
    "covariance of the grid's coefficients (iid errors) + Bernoulli outcome variance"
)


@dataclass(frozen=True, slots=True)
class QuantileFit:
    """Quantile lines ``log actual = intercept_k + slope_k · log predicted`` at ``taus``."""

    taus: np.ndarray
    intercepts: np.ndarray
    slopes: np.ndarray
    sparsity: np.ndarray
    xtx_inv: np.ndarray
    rows: int

    def cdf(self, log_predicted: np.ndarray, log_bound: np.ndarray) -> np.ndarray:
        """P(actual ≤ bound | predicted) for each request."""
        return _share_below(self.intercepts, self.slopes, log_predicted, log_bound)

    def joint_covariance(self) -> np.ndarray:
        """Cov of ``[a_1, b_1, a_2, b_2, …]`` under iid errors (module docstring)."""
        tau, s = self.taus, self.sparsity
        bridge = (np.minimum.outer(tau, tau) - np.outer(tau, tau)) * np.outer(s, s)
        return np.kron(bridge, self.xtx_inv)


def _share_below(
    intercepts: np.ndarray, slopes: np.ndarray, x: np.ndarray, y: np.ndarray
) -> np.ndarray:
    """Share of the quantile lines at or below ``y`` at ``x``; the leading axes of
    ``intercepts``/``slopes`` (before the grid axis) broadcast against the requests."""
    below = np.zeros(np.broadcast_shapes((*intercepts.shape[:-1], 1), x.shape))
    for k in range(intercepts.shape[-1]):
        a, b = intercepts[..., k, None], slopes[..., k, None]
        below += (a + b * x) <= y
    return below / intercepts.shape[-1]


def midpoint_grid(k: int) -> np.ndarray:
    return (np.arange(k) + 0.5) / k


def fit_quantiles(log_predicted: np.ndarray, log_actual: np.ndarray, grid: int) -> QuantileFit:
    """One statsmodels QuantReg per τ of the midpoint grid."""
    exog = np.column_stack([np.ones_like(log_predicted), log_predicted])
    taus = midpoint_grid(grid)
    params, sparsity = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # iteration-limit notes on near-degenerate samples
        for tau in taus:
            result = QuantReg(log_actual, exog).fit(q=float(tau), vcov="iid")
            params.append(np.asarray(result.params, dtype=np.float64))
            sparsity.append(float(result.sparsity))
    coef = np.asarray(params)
    return QuantileFit(
        taus=taus,
        intercepts=coef[:, 0],
        slopes=coef[:, 1],
        sparsity=np.asarray(sparsity),
        xtx_inv=np.linalg.pinv(exog.T @ exog),
        rows=len(log_actual),
    )


@dataclass(frozen=True, slots=True)
class BoundEstimate:
    """Estimated false alarms among the rejected requests with one bound."""

    bound_s: float
    rejected: int
    estimable: int  # rejected with a positive prediction
    estimated_false_alarms: float | None
    lo: float | None
    hi: float | None
    rate: float | None  # estimated_false_alarms / estimable
    fit_sd: float | None
    outcome_sd: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_based(
    served_predicted: np.ndarray,
    served_actual: np.ndarray,
    rejected_predicted: np.ndarray,
    rejected_bound: np.ndarray,
    *,
    grid: int = GRID,
    fit_rows: int = FIT_ROWS,
    draws: int = DRAWS,
    draw_rows: int = DRAW_ROWS,
    seed: int = SEED,
) -> list[BoundEstimate]:
    """Estimate (a) per bound value (module docstring). Arrays are in seconds; served
    pairs and rejected requests without a positive prediction are left out (a rejected
    one is then counted in ``rejected`` but not in ``estimable``)."""
    rng = np.random.default_rng(seed)
    bounds, bound_index = np.unique(
        np.asarray(rejected_bound, dtype=np.float64), return_inverse=True
    )
    rejected_counts = np.bincount(bound_index, minlength=len(bounds))
    usable = np.isfinite(rejected_predicted) & (rejected_predicted > 0)
    ok = (served_predicted > 0) & (served_actual > 0)
    ok &= np.isfinite(served_predicted) & np.isfinite(served_actual)
    x_fit, y_fit = np.log(served_predicted[ok]), np.log(served_actual[ok])
    if len(x_fit) > fit_rows:
        keep = rng.choice(len(x_fit), fit_rows, replace=False)
        x_fit, y_fit = x_fit[keep], y_fit[keep]
    estimable = np.bincount(bound_index[usable], minlength=len(bounds))
    if len(x_fit) < MIN_FIT_ROWS:
        return [
            BoundEstimate(float(b), int(n), int(e), None, None, None, None, None, None)
            for b, n, e in zip(bounds, rejected_counts, estimable, strict=True)
        ]
    fit = fit_quantiles(x_fit, y_fit, grid)
    x, y, which = (
        np.log(rejected_predicted[usable]),
        np.log(bounds[bound_index[usable]]),
        bound_index[usable],
    )
    p = fit.cdf(x, y)
    estimate = np.bincount(which, weights=p, minlength=len(bounds))
    outcome_var = np.bincount(which, weights=p * (1 - p), minlength=len(bounds))
    fit_var = _fit_variance(fit, x, y, which, len(bounds), draws, draw_rows, rng)
    out = []
    for b in range(len(bounds)):
        sd = math.sqrt(fit_var[b] + outcome_var[b])
        n = int(estimable[b])
        out.append(
            BoundEstimate(
                bound_s=float(bounds[b]),
                rejected=int(rejected_counts[b]),
                estimable=n,
                estimated_false_alarms=float(estimate[b]),
                lo=max(0.0, float(estimate[b]) - Z95 * sd),
                hi=min(float(n), float(estimate[b]) + Z95 * sd),
                rate=float(estimate[b]) / n if n else None,
                fit_sd=math.sqrt(fit_var[b]),
                outcome_sd=math.sqrt(outcome_var[b]),
            )
        )
    return out


def _fit_variance(
    fit: QuantileFit,
    x: np.ndarray,
    y: np.ndarray,
    which: np.ndarray,
    n_bounds: int,
    draws: int,
    draw_rows: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Per bound, the variance of the estimated sum over coefficient grids drawn from the
    fit's joint asymptotic normal (evaluated on a sample of the requests, scaled up)."""
    if draws < 2 or len(x) == 0:
        return np.zeros(n_bounds)
    sample = rng.choice(len(x), draw_rows, replace=False) if len(x) > draw_rows else slice(None)
    xs, ys, ws = x[sample], y[sample], which[sample]
    scale = np.bincount(which, minlength=n_bounds) / np.maximum(
        np.bincount(ws, minlength=n_bounds), 1
    )
    mean = np.column_stack([fit.intercepts, fit.slopes]).ravel()
    factor = _psd_factor(fit.joint_covariance())
    coef = (mean[None, :] + rng.standard_normal((draws, len(mean))) @ factor.T).reshape(
        draws, len(fit.taus), 2
    )
    p = _share_below(coef[..., 0], coef[..., 1], xs[None, :], ys[None, :])  # draws × rows
    onehot = np.zeros((len(xs), n_bounds))
    onehot[np.arange(len(xs)), ws] = 1.0
    sums = (p @ onehot) * scale[None, :]
    variance: np.ndarray = sums.var(axis=0, ddof=1)
    return variance


def _psd_factor(cov: np.ndarray) -> np.ndarray:
    """F with F·Fᵀ = cov for a positive semi-definite cov (eigen-decomposition)."""
    values, vectors = np.linalg.eigh((cov + cov.T) / 2)
    factor: np.ndarray = vectors * np.sqrt(np.clip(values, 0.0, None))[None, :]
    return factor


# --------------------------------------------------------------------------- direct


def wilson_interval(successes: int, trials: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of a binomial proportion (None without trials)."""
    if trials <= 0:
        return None
    p = successes / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, center - half), min(1.0, center + half)


# --------------------------------------------------------------------------- from a lake

SERVED_PAIRS: Final = """
SELECT predicted_ttft_s, actual_ttft_s FROM graded
WHERE status = 'served' AND predicted_ttft_s > 0 AND actual_ttft_s > 0
"""
# A uniform sample of the fit rows, drawn by DuckDB (integers only are formatted in).
SAMPLE: Final = "SELECT * FROM ({pairs}) USING SAMPLE reservoir({rows} ROWS) REPEATABLE ({seed})"
# The predictor's own would-be rejections, as the false_alarms view counts them: the others
# (no worker holds the prompt or serves the model, the latency controls shed the class, the
# router's fallback) no delay could turn, so they are no false alarms (PRODUCT.md §4).
REJECTED: Final = """
SELECT coalesce(predicted_ttft_s, 'NaN'::DOUBLE) AS predicted_ttft_s, max_queue_wait_s
FROM graded WHERE NOT admitted AND max_queue_wait_s IS NOT NULL AND NOT fallback
  AND coalesce(reject_reason, 'predicted_ttft_exceeds_bound')
      IN ('predicted_ttft_exceeds_bound', 'prefill_exceeds_bound', 'overloaded')
"""


def estimate(con: duckdb.DuckDBPyConnection, **options: Any) -> dict[str, Any]:
    """Both estimates per bound, from the lake behind ``con``
    (:func:`foretoken.adapters.lake.views.connect`)."""
    fit_rows = int(options.get("fit_rows", FIT_ROWS))
    seed = int(options.get("seed", SEED))
    served = query(con, SAMPLE.format(pairs=SERVED_PAIRS, rows=fit_rows, seed=seed))
    rejected = query(con, REJECTED)
    model = model_based(
        served["predicted_ttft_s"].to_numpy(),
        served["actual_ttft_s"].to_numpy(),
        rejected["predicted_ttft_s"].to_numpy(),
        rejected["max_queue_wait_s"].to_numpy(),
        **options,
    )
    return {
        "model_based": [e.to_dict() for e in model],
        "model_method": METHOD,
        "model_fit_rows": served.height,
        "direct": rows(con, "SELECT * FROM false_alarms"),
    }
