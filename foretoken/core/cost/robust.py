"""The robust core of the online fits (:mod:`foretoken.core.cost.fit`): the decayed,
windowed, non-negative IRLS fit of ``y ≈ θ0·x0 + θ1·x1`` on relative residuals and its
sandwich covariance, with its configuration.

Pure: numpy and msgspec only. The method is described in :mod:`foretoken.core.cost.fit`'s
module doc.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from foretoken.core.checks import check_settings_numbers

FloatArray = npt.NDArray[np.float64]
Covariance = tuple[float, float, float]  # (var θ0, cov θ0·θ1, var θ1)

MAD_TO_SIGMA: Final = 1.4826  # MAD → standard deviation for a normal distribution
MIN_PREDICTION_FRACTION: Final = 1e-9  # ŷ is floored at this fraction of y (finite 1/ŷ)


@dataclass(frozen=True, slots=True)
class RobustFitConfig:
    """The robust, decayed, windowed fit shared by the prefill and the step model."""

    window: int = 256  # samples kept, oldest dropped
    min_samples: int = 8  # no fit (the default) below this many samples
    half_life_samples: float | None = 32.0  # a weight halves every this many newer samples
    half_life_s: float | None = None  # … and/or every this many seconds of sample time
    refit_every: int = 4  # refit after this many new samples (the first fit at once)
    huber_c: float = 1.345
    tukey_c: float = 4.685
    huber_iterations: int = 2
    max_iterations: int = 20
    tolerance: float = 1e-4  # relative change of θ that ends the iterations
    min_relative_scale: float = 0.01  # floor of the residual scale (noiseless data)

    def __post_init__(self) -> None:
        check_settings_numbers(self)
        if self.min_samples < 2 or self.window < self.min_samples:
            raise ValueError("min_samples must be >= 2 and window >= min_samples")
        if self.refit_every < 1 or self.max_iterations < 1:
            raise ValueError("refit_every and max_iterations must be >= 1")
        for half_life in (self.half_life_samples, self.half_life_s):
            if half_life is not None and not half_life > 0:
                raise ValueError("half-lives must be > 0 (or None for no decay)")


class _Solution(msgspec.Struct, array_like=True, frozen=True):
    theta0: float
    theta1: float
    cov: Covariance | None
    samples: int = 0  # the window's size when fitted


def _nnls2(sums: FloatArray) -> tuple[float, float] | None:
    """Minimize ``θᵀGθ − 2hᵀθ`` over θ ≥ 0 exactly, from ``sums = (G00, G01, G11, h0, h1)``:
    the unconstrained solution if feasible, else the better one-sided one (the KKT points
    of a convex quadratic). None when a column carries no weight."""
    g00, g01, g11, h0, h1 = (float(v) for v in sums)
    if not (g00 > 0 and g11 > 0):
        return None
    det = g00 * g11 - g01 * g01
    if det > 0:
        th0, th1 = (g11 * h0 - g01 * h1) / det, (g00 * h1 - g01 * h0) / det
        if th0 >= 0 and th1 >= 0:
            return th0, th1
    only0, only1 = max(h0 / g00, 0.0), max(h1 / g11, 0.0)
    if g00 * only0 * only0 - 2 * h0 * only0 <= g11 * only1 * only1 - 2 * h1 * only1:
        return only0, 0.0
    return 0.0, only1


def _weighted_median(values: FloatArray, weights: FloatArray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, 0.5 * cumulative[-1]))
    return float(values[order[min(index, len(values) - 1)]])


def _fit_robust(
    x0: FloatArray, x1: FloatArray, y: FloatArray, decay: FloatArray, cfg: RobustFitConfig
) -> _Solution | None:
    """Robust non-negative fit of ``y ≈ θ0·x0 + θ1·x1`` on relative residuals (module doc).

    A least-squares step with row weights ``v`` needs only ``G = Σ v·u uᵀ`` and
    ``h = Σ v·u·y`` (u: the columns scaled to ≤ 1, for conditioning), so the products are
    formed once and each step is one product ``products @ v``; the relative residual's row
    scaling ``1/ŷ`` is folded into ``v``.
    """
    s0, s1 = float(np.max(np.abs(x0))), float(np.max(np.abs(x1)))
    if not (s0 > 0 and s1 > 0):
        return None
    u = np.stack((x0 / s0, x1 / s1))
    products = np.stack((u[0] * u[0], u[0] * u[1], u[1] * u[1], u[0] * y, u[1] * y))
    floor = y * MIN_PREDICTION_FRACTION
    start = _nnls2(products @ (decay / (y * y)))  # least squares relative to observations
    if start is None:
        return None
    theta = np.array(start)
    scale = cfg.min_relative_scale
    for iteration in range(cfg.max_iterations):
        inv_pred = 1.0 / np.maximum(theta @ u, floor)
        resid = y * inv_pred - 1.0
        huber = iteration < cfg.huber_iterations
        if huber:  # re-estimate the scale while the fit still moves, then freeze it
            magnitude = np.abs(resid)  # the MAD about zero, as statsmodels' RLM takes it
            scale = max(MAD_TO_SIGMA * _weighted_median(magnitude, decay), cfg.min_relative_scale)
            robust = np.minimum(1.0, (cfg.huber_c * scale) / np.maximum(magnitude, scale))
        else:
            keep = np.maximum(1.0 - resid * resid * (1.0 / (cfg.tukey_c * scale) ** 2), 0.0)
            robust = keep * keep
        step = _nnls2(products @ (decay * robust * inv_pred * inv_pred))
        if step is None:
            break
        new = np.array(step)
        change = float(np.abs(new - theta).sum())
        theta = new
        if not huber and change <= cfg.tolerance * float(theta.sum()):
            break
    inv_pred = 1.0 / np.maximum(theta @ u, floor)
    resid = y * inv_pred - 1.0
    z2 = resid * resid * (1.0 / (cfg.tukey_c * scale) ** 2)
    keep = np.maximum(1.0 - z2, 0.0)  # Tukey's ψ(z)/z = keep², ψ'(z) = keep·(1 − 5z²)
    cov = _sandwich(products[:3], inv_pred, resid, decay * keep * keep, decay * keep * (1 - 5 * z2))
    if cov is not None:
        cov = (cov[0] / (s0 * s0), cov[1] / (s0 * s1), cov[2] / (s1 * s1))
    return _Solution(float(theta[0]) / s0, float(theta[1]) / s1, cov, len(y))


def _sandwich(
    gram_products: FloatArray,
    inv_pred: FloatArray,
    resid: FloatArray,
    weights: FloatArray,
    slopes: FloatArray,
) -> Covariance | None:
    """The M-estimator sandwich ``B⁻¹ M B⁻¹``: ``B = Σ d·ψ'·a aᵀ`` (``slopes``),
    ``M = Σ (d·w·e)²·a aᵀ`` (``weights`` = d·w), rows ``a = u/ŷ``, relative residuals
    ``e``; times n/(n − 2) for the n inliers. None if B is not positive definite."""
    inv2 = inv_pred * inv_pred
    g00, g01, g11 = (float(v) for v in gram_products @ (slopes * inv2))
    m00, m01, m11 = (float(v) for v in gram_products @ (weights * weights * resid * resid * inv2))
    det = g00 * g11 - g01 * g01
    inliers = int(np.count_nonzero(weights > 0))
    if not (det > 0 and g00 > 0) or inliers <= 2:
        return None
    i00, i01, i11 = g11 / det, -g01 / det, g00 / det
    correction = inliers / (inliers - 2)
    c00 = i00 * (i00 * m00 + i01 * m01) + i01 * (i00 * m01 + i01 * m11)
    c01 = i00 * (i01 * m00 + i11 * m01) + i01 * (i01 * m01 + i11 * m11)
    c11 = i01 * (i01 * m00 + i11 * m01) + i11 * (i01 * m01 + i11 * m11)
    return (c00 * correction, c01 * correction, c11 * correction)
