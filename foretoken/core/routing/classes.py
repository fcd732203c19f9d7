"""Workload classes and the settings of the staged latency controls (pure values).

A workload class names a TTFT objective at a percentile; the latency controls
(:mod:`foretoken.core.routing.controls`) keep each class's queue time on each worker within
the budget it leaves. These are the core's own configuration types: the one settings object
(``foretoken.settings``) nests them, and the core never imports the settings module.
"""

from __future__ import annotations

import math

import msgspec

from foretoken.core.checks import check_settings_numbers


class WorkloadClass(msgspec.Struct, kw_only=True, frozen=True):
    """A workload class (issue #8): its TTFT objective at a percentile, the latency it
    expects outside the queue (own prefill, network) and a safety margin give its
    queue-time budget; plus the bound its requests get by default, and its priority."""

    objective_ttft_s: float = 30.0
    percentile: float = 95.0
    non_queue_latency_s: float = 2.0
    margin_s: float = 1.0
    # Applied when a request of this class names no max_queue_wait_s (None: no bound).
    max_queue_wait_s: float | None = None
    # Higher = more important; admission control rejects lower priorities first.
    priority: int = 0
    # Protected classes are never rejected by the admission control of the latency controls.
    protected: bool = False

    def __post_init__(self) -> None:
        check_settings_numbers(self, signed=("priority",))
        if not 50.0 <= self.percentile < 100.0:
            raise ValueError(f"percentile must be within [50, 100), got {self.percentile}")
        if self.queue_budget_s <= 0:
            raise ValueError(
                f"objective_ttft_s ({self.objective_ttft_s}) leaves no queue-time budget "
                f"after non_queue_latency_s + margin_s"
            )

    @property
    def queue_budget_s(self) -> float:
        """objective − non-queue latency − margin: what the queue may take at the tail."""
        return self.objective_ttft_s - self.non_queue_latency_s - self.margin_s


class ControlSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The staged latency controls (``predictor/controls.py``); thresholds are fractions of
    each class's queue budget."""

    enabled: bool = True
    default_class: str = "default"
    classes: dict[str, WorkloadClass] = msgspec.field(
        default_factory=lambda: {"default": WorkloadClass()}
    )
    window_s: float = 60.0
    min_samples: int = 20
    warn_fraction: float = 0.5
    reroute_fraction: float = 0.75
    admission_fraction: float = 1.0
    # A stage is left when the tail stays below this fraction of its threshold (hysteresis).
    recovery_fraction: float = 0.7
    # A breach (or a recovery) must last this long before the stage changes.
    breach_s: float = 10.0
    recovery_s: float = 20.0
    evaluate_every_s: float = 1.0
    # Reroute and admission need pressure on the worker: at least this many prompt tokens
    # queued there at some point in the window (or arrivals > first tokens, or timeouts).
    corroborating_queue_tokens: int = 8192
    # Retry-After of a request turned away by admission control.
    admission_retry_after_s: float = 5.0
    # An admitted request without an outcome counts (as a lower bound of its queue time, and
    # its prompt in the worker's queued tokens) until its horizon: this many times its
    # predicted TTFT (the class's objective when it has none), at least pending_horizon_min_s
    # and at most pending_max_age_s (the processor caps that at router.engine_timeout_s, by
    # which the router has ended every request). Then it is taken as lost.
    pending_horizon_factor: float = 4.0
    pending_horizon_min_s: float = 30.0
    pending_max_age_s: float = 900.0

    def __post_init__(self) -> None:
        check_settings_numbers(self)
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not among the classes")
        if not 0 < self.warn_fraction <= self.reroute_fraction <= self.admission_fraction:
            raise ValueError("need 0 < warn_fraction <= reroute_fraction <= admission_fraction")
        if not 0 < self.recovery_fraction < 1:
            raise ValueError("recovery_fraction must be within (0, 1)")
        if self.window_s <= 0 or self.min_samples < 1:
            raise ValueError("window_s must be > 0 and min_samples >= 1")
        if not 0 < self.pending_horizon_min_s <= self.pending_max_age_s:
            raise ValueError("need 0 < pending_horizon_min_s <= pending_max_age_s")
        if self.pending_horizon_factor < 1:
            raise ValueError("pending_horizon_factor must be >= 1")

    def pending_horizon_s(self, predicted_ttft_s: float | None, klass: WorkloadClass) -> float:
        """How long an admitted request without an outcome counts (see the fields)."""
        expected = klass.objective_ttft_s
        if predicted_ttft_s is not None and math.isfinite(predicted_ttft_s):
            expected = predicted_ttft_s
        span = self.pending_horizon_factor * max(0.0, expected)
        return min(max(span, self.pending_horizon_min_s), self.pending_max_age_s)

    def workload_class(self, name: str | None) -> tuple[str, WorkloadClass]:
        """The class of that name; unknown or empty names fall back to the default class."""
        if name and name in self.classes:
            return name, self.classes[name]
        return self.default_class, self.classes[self.default_class]
