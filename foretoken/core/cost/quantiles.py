"""Calibrated upper quantiles of TTFT (issue 15 "uncertainty that means something").

A point prediction says what TTFT to expect; a router that admits against a bound also
needs how wrong it may be. :class:`TtftQuantiles` learns that from the graded requests the
route service already sees (its own predictions joined with what the router measured), by
*online conformal calibration*: per worker it keeps the latest residuals

    r = log((actual + s0) / (predicted + s0))

and predicts the q-quantile of TTFT as ``(predicted + s0)·exp(Q_q(r)) − s0``, where
``Q_q`` is the empirical q-quantile of the window. The shift ``s0`` (``floor_s``) keeps tiny
TTFTs from dominating with huge ratios. Residuals are kept apart by the prediction's regime
(Mondrian calibration): whether it predicted a queue wait, and whether the worker's curve was
still its default one — a cold worker's pessimistic default errs in a way a fitted one does
not. A residual is taken as soon as the request's first token is measured (the route
service still holds its decision), else from its graded record — once per request; waiting
for the graded record (at the completion) would leave an overload's windows empty while the
decode runs. A worker with too few residuals of a regime borrows the fleet's (same regime); with
none at all the quantile is ``default_factor`` times the shifted prediction (conservative,
not absurd). Everything here is observed by the pipeline; nothing reads a simulator's truth.

Because each window holds the latest residuals of the very predictor it corrects, the
coverage ``P(actual ≤ Q_q)`` tracks q as the predictor or the fleet changes; the report
shows it (``p90_coverage``). Under a drift faster than outcomes come back (an overload whose
queue keeps growing) a window lags and covers less. An adaptive correction of the level
(adaptive conformal inference, steps of 0.01 per miss in level or 0.05 in log units) was
measured on the accuracy matrix and did not help there (it tracked the drift as late as the
windows and added noise elsewhere), so it is not used.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from foretoken.core.types import RequestId, WorkerId

Regime = tuple[bool, bool]  # (queued, default curve)


@dataclass(frozen=True, slots=True)
class QuantileConfig:
    # Residuals kept per (worker, regime) and for the fleet's pool of each regime.
    window: int = 400
    pool_window: int = 2000
    # A worker's own residuals are used once it has this many of the regime.
    min_samples: int = 30
    # The additive shift s0 of the log-ratio residuals, in seconds.
    floor_s: float = 0.1
    # With no residual at all: Q = default_factor·(predicted + s0) − s0.
    default_factor: float = 2.0
    # A window's quantiles are recomputed after this many new residuals.
    refresh_every: int = 8
    # A prediction counts as queued when its predicted queue wait exceeds this.
    queued_above_s: float = 0.05
    # Request ids remembered so that one request is one residual.
    memory: int = 100_000

    def __post_init__(self) -> None:
        if min(self.window, self.pool_window, self.min_samples, self.refresh_every) < 1:
            raise ValueError("window, pool_window, min_samples and refresh_every must be >= 1")
        if self.floor_s <= 0 or self.default_factor < 1:
            raise ValueError("need floor_s > 0 and default_factor >= 1")


class _Window:
    """The latest residuals of one (worker, regime), with the quantiles read from them."""

    __slots__ = ("_cache", "_since", "refresh_every", "residuals")

    def __init__(self, size: int, refresh_every: int) -> None:
        self.residuals: deque[float] = deque(maxlen=size)
        self.refresh_every = refresh_every
        self._cache: dict[float, float] = {}
        self._since = 0

    def add(self, r: float) -> None:
        self.residuals.append(r)
        self._since += 1
        if self._since >= self.refresh_every or len(self.residuals) <= self.refresh_every:
            self._cache.clear()
            self._since = 0

    def quantile(self, q: float) -> float:
        value = self._cache.get(q)
        if value is None:
            # "higher": the conformal choice, never below the q-th order statistic
            value = float(np.quantile(np.fromiter(self.residuals, float), q, method="higher"))
            self._cache[q] = value
        return value


class TtftQuantiles:
    """Upper quantiles of TTFT per worker, calibrated online (see the module)."""

    def __init__(self, config: QuantileConfig = QuantileConfig()) -> None:
        self.config = config
        self._own: dict[tuple[WorkerId, Regime], _Window] = {}
        self._pool: dict[Regime, _Window] = {}
        self._seen: OrderedDict[RequestId, None] = OrderedDict()
        self.observed = 0

    @staticmethod
    def regime(queue_wait_s: float | None, default_fit: bool | None, above_s: float) -> Regime:
        return (queue_wait_s or 0.0) > above_s, bool(default_fit)

    def observe(
        self, request_id: RequestId, worker: WorkerId, predicted_s: float, actual_s: float,
        queue_wait_s: float | None, default_fit: bool | None,
    ) -> bool:  # fmt: skip
        """One served request's prediction and measured TTFT; False if unusable or if the
        request was observed already."""
        if not (math.isfinite(predicted_s) and math.isfinite(actual_s)):
            return False
        if predicted_s < 0 or actual_s < 0 or request_id in self._seen:
            return False
        cfg = self.config
        self._seen[request_id] = None
        if len(self._seen) > cfg.memory:
            self._seen.popitem(last=False)
        r = math.log((actual_s + cfg.floor_s) / (predicted_s + cfg.floor_s))
        regime = self.regime(queue_wait_s, default_fit, cfg.queued_above_s)
        own = self._own.get((worker, regime))
        if own is None:
            own = self._own[(worker, regime)] = _Window(cfg.window, cfg.refresh_every)
        own.add(r)
        pool = self._pool.get(regime)
        if pool is None:
            pool = self._pool[regime] = _Window(cfg.pool_window, cfg.refresh_every)
        pool.add(r)
        self.observed += 1
        return True

    def upper(
        self, worker: WorkerId, predicted_s: float, q: float,
        queue_wait_s: float | None, default_fit: bool | None,
    ) -> float:  # fmt: skip
        """The q-quantile of the TTFT predicted as ``predicted_s`` on ``worker`` (>= 0)."""
        cfg = self.config
        regime = self.regime(queue_wait_s, default_fit, cfg.queued_above_s)
        window = self._own.get((worker, regime))
        if window is None or len(window.residuals) < cfg.min_samples:
            window = self._pool.get(regime)
        shifted = predicted_s + cfg.floor_s
        if window is None or len(window.residuals) < cfg.min_samples:
            return max(0.0, shifted * cfg.default_factor - cfg.floor_s)
        return max(0.0, shifted * math.exp(window.quantile(q)) - cfg.floor_s)

    def forget(self, worker: WorkerId) -> None:
        """A worker removed: its own residuals go (the pool keeps what they taught)."""
        for key in [k for k in self._own if k[0] == worker]:
            del self._own[key]
