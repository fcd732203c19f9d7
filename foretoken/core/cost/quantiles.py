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
none at all the quantile is ``default_factor`` (1.6) times the shifted prediction
(conservative, not absurd; 2.0 covered 0.93 of the routed matrices' requests, 1.3 0.88 —
docs/BENCHMARKS.md "The default factor, measured again"). Everything here is observed by
the pipeline; nothing reads a simulator's truth.

Because each window holds the latest residuals of the very predictor it corrects, the
coverage ``P(actual ≤ Q_q)`` tracks q as the predictor or the fleet changes; the report
shows it (``p90_coverage``). Under a drift faster than outcomes come back (an overload whose
queue keeps growing) a window lags and covers less. An adaptive correction of the level
(adaptive conformal inference, steps of 0.01 per miss in level or 0.05 in log units) was
measured on the accuracy matrix and did not help there (it tracked the drift as late as the
windows and added noise elsewhere), so it is not used; nor is a decay of the residuals'
weights by age (half-lives of 16-64 residuals: no change on the matrix, whose windows of
a 400-request cell rarely roll).

**Censored residuals.** Residuals come back in the order requests finish, so while a
queue grows the window holds the requests that finished soonest — mostly the
over-predicted ones — and its quantile is too low just when it matters. A request decided
here (:meth:`TtftQuantiles.sent`) and still waiting at ``now`` has a residual of at least
``log((now − decided + s0) / (predicted + s0))``; when that lower bound already passes the
window's quantile, the request is counted at its bound (a right-censored observation
known to lie above the quantile) and the quantile is read again from both. Requests whose
bound has not passed it are left out, as before. This is what ``upper`` does when given
``now_s``; the route service gives it the decision's clock.
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
    default_factor: float = 1.6
    # A window's quantiles are recomputed after this many new residuals.
    refresh_every: int = 8
    # A prediction counts as queued when its predicted queue wait exceeds this.
    queued_above_s: float = 0.05
    # Request ids remembered so that one request is one residual.
    memory: int = 100_000
    # Censored residuals (module doc): requests decided here still waiting for their first
    # token count at their lower bound once it passes a window's quantile. A window's
    # correction is recomputed at most once per this many seconds of the service's clock;
    # a request still waiting after pending_max_s is forgotten.
    censored: bool = True
    censor_refresh_s: float = 0.05
    pending_max_s: float = 600.0

    def __post_init__(self) -> None:
        if min(self.window, self.pool_window, self.min_samples, self.refresh_every) < 1:
            raise ValueError("window, pool_window, min_samples and refresh_every must be >= 1")
        if self.floor_s <= 0 or self.default_factor < 1:
            raise ValueError("need floor_s > 0 and default_factor >= 1")
        if self.censor_refresh_s < 0 or not self.pending_max_s > 0:
            raise ValueError("need censor_refresh_s >= 0 and pending_max_s > 0")


class _Window:
    """The latest residuals of one (worker, regime), with the quantiles read from them."""

    __slots__ = ("_cache", "_since", "refresh_every", "residuals", "version")

    def __init__(self, size: int, refresh_every: int) -> None:
        self.residuals: deque[float] = deque(maxlen=size)
        self.refresh_every = refresh_every
        self._cache: dict[float, float] = {}
        self._since = 0
        self.version = 0  # moves whenever the quantiles are read afresh

    def add(self, r: float) -> None:
        self.residuals.append(r)
        self._since += 1
        if self._since >= self.refresh_every or len(self.residuals) <= self.refresh_every:
            self._cache.clear()
            self._since = 0
            self.version += 1

    def quantile(self, q: float) -> float:
        value = self._cache.get(q)
        if value is None:
            value = _quantile(np.fromiter(self.residuals, float), q)
            self._cache[q] = value
        return value


def _quantile(values: np.ndarray, q: float) -> float:
    """The conformal q-quantile of residuals: ``higher``, never below the q-th order
    statistic."""
    return float(np.quantile(values, q, method="higher"))


class _Pending:
    """Requests of one group (a worker's regime, or the fleet's) decided and not yet
    answered: ``decided_s`` and ``predicted + s0`` per request, in decision order."""

    __slots__ = ("_cache", "items")

    def __init__(self) -> None:
        self.items: OrderedDict[RequestId, tuple[float, float]] = OrderedDict()
        self._cache: dict[float, tuple[float, int, float]] = {}  # q -> (at, version, value)

    def censored(self, window: _Window, q: float, now_s: float, cfg: QuantileConfig) -> float:
        """The window's q-quantile with the censored residuals that passed it (module doc)."""
        base = window.quantile(q)
        if not self.items:
            return base
        known = self._cache.get(q)
        version = window.version
        if (
            known is not None
            and known[1] == version
            and 0 <= now_s - known[0] < cfg.censor_refresh_s
        ):
            return known[2]
        while self.items:  # the oldest first: drop those waiting past pending_max_s
            decided_s = next(iter(self.items.values()))[0]
            if now_s - decided_s <= cfg.pending_max_s:
                break
            self.items.popitem(last=False)
        value = base
        if self.items:
            pending = np.array(list(self.items.values()), dtype=float).reshape(-1, 2)
            bounds = np.log(np.maximum(now_s - pending[:, 0], 0.0) + cfg.floor_s) - np.log(
                pending[:, 1]
            )
            passed = bounds[bounds > base]
            if len(passed):  # as the newest residuals: they are still running
                values = np.concatenate([np.fromiter(window.residuals, float), passed])
                value = _quantile(values, q)
        self._cache[q] = (now_s, version, value)
        return value


class TtftQuantiles:
    """Upper quantiles of TTFT per worker, calibrated online (see the module)."""

    def __init__(self, config: QuantileConfig = QuantileConfig()) -> None:
        self.config = config
        self._own: dict[tuple[WorkerId, Regime], _Window] = {}
        self._pool: dict[Regime, _Window] = {}
        self._seen: OrderedDict[RequestId, None] = OrderedDict()
        self.observed = 0
        # censored residuals: each waiting request's groups, by (worker, regime) and regime
        self._waiting: OrderedDict[RequestId, tuple[WorkerId, Regime]] = OrderedDict()
        self._pending_own: dict[tuple[WorkerId, Regime], _Pending] = {}
        self._pending_pool: dict[Regime, _Pending] = {}

    def sent(
        self, request_id: RequestId, worker: WorkerId, predicted_s: float,
        queue_wait_s: float | None, default_fit: bool | None, now_s: float,
    ) -> None:  # fmt: skip
        """A request decided here at ``now_s`` (the clock of ``upper``'s ``now_s``): until
        its residual comes, it is a censored one, at least ``log((now − decided + s0) /
        (predicted + s0))``."""
        cfg = self.config
        if not cfg.censored or not math.isfinite(predicted_s) or predicted_s < 0:
            return
        if request_id in self._seen or request_id in self._waiting:
            return
        regime = self.regime(queue_wait_s, default_fit, cfg.queued_above_s)
        item = (now_s, predicted_s + cfg.floor_s)
        self._waiting[request_id] = (worker, regime)
        self._pending_own.setdefault((worker, regime), _Pending()).items[request_id] = item
        self._pending_pool.setdefault(regime, _Pending()).items[request_id] = item
        if len(self._waiting) > cfg.memory:
            self.drop(next(iter(self._waiting)))

    def drop(self, request_id: RequestId) -> None:
        """A request that will bring no residual (failed, withdrawn, expired)."""
        groups = self._waiting.pop(request_id, None)
        if groups is None:
            return
        own = self._pending_own.get(groups)
        if own is not None:
            own.items.pop(request_id, None)
        pool = self._pending_pool.get(groups[1])
        if pool is not None:
            pool.items.pop(request_id, None)

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
        self.drop(request_id)
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
        queue_wait_s: float | None, default_fit: bool | None, now_s: float | None = None,
    ) -> float:  # fmt: skip
        """The q-quantile of the TTFT predicted as ``predicted_s`` on ``worker`` (>= 0);
        with ``now_s``, the censored residuals of requests still waiting count too."""
        cfg = self.config
        regime = self.regime(queue_wait_s, default_fit, cfg.queued_above_s)
        window = self._own.get((worker, regime))
        pending = self._pending_own.get((worker, regime))
        if window is None or len(window.residuals) < cfg.min_samples:
            window, pending = self._pool.get(regime), self._pending_pool.get(regime)
        shifted = predicted_s + cfg.floor_s
        if window is None or len(window.residuals) < cfg.min_samples:
            return max(0.0, shifted * cfg.default_factor - cfg.floor_s)
        if now_s is None or pending is None:
            r = window.quantile(q)
        else:
            r = pending.censored(window, q, now_s, cfg)
        return max(0.0, shifted * math.exp(r) - cfg.floor_s)

    def forget(self, worker: WorkerId) -> None:
        """A worker removed: its own residuals go (the pool keeps what they taught)."""
        for key in [k for k in self._own if k[0] == worker]:
            del self._own[key]
        for rid in [r for r, groups in self._waiting.items() if groups[0] == worker]:
            self.drop(rid)
