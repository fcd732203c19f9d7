"""The one place the processor's core is put together: cache index, fits, route service,
latency controls and grading join, from the settings.

Both the live processor (the Faust application, :mod:`foretoken.adapters.kafka.app`) and the
virtual-time replay (:mod:`foretoken.sim.predictor_policy`) build a :class:`ProcessorCore`
here and feed it the same observations in the same order, so what the replay measures is
what the processor runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from foretoken.core.cost.registry import FitRegistry
from foretoken.core.grading.join import GradingJoin, JoinConfig
from foretoken.core.index.approx import ApproxCacheConfig, index_params
from foretoken.core.index.protocol import Index
from foretoken.core.routing.classes import ControlSettings
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.controls import LatencyControls
from foretoken.core.routing.service import RouteService
from foretoken.core.types import (
    GradedRequest,
    RequestOutcome,
    RouteDecision,
    WorkerId,
    WorkerProfile,
)
from foretoken.settings import Settings


@dataclass
class ProcessorCore:
    """The stateful core of the processor: every part, wired once."""

    index: Index
    service: RouteService
    join: GradingJoin
    controls: LatencyControls | None
    approx: ApproxCacheConfig
    join_config: JoinConfig = field(default_factory=JoinConfig)
    # Every registered worker's profile (the join asks for block sizes and reuse reports).
    directory: dict[WorkerId, WorkerProfile] = field(default_factory=dict)

    def register(self, profile: WorkerProfile, *, index: bool = True) -> None:
        """A ``workers`` record: to the directory, the route service and (unless the caller
        keeps the index itself, as the processor's index keeper does) the index."""
        wid = profile.worker_id
        if profile.removed:
            self.directory.pop(wid, None)
            if index:
                self.index.remove_worker(wid)
        else:
            self.directory[wid] = profile
            if index:
                ttl_s, capacity = index_params(profile, self.approx)
                self.index.register_worker(
                    wid, profile.model, profile.block_size, eagle=profile.eagle,
                    store_only_ttl_s=ttl_s, capacity_blocks=capacity,
                )  # fmt: skip
        self.service.on_registration(profile)

    def use_index(self, index: Index) -> None:
        """Another index from now on (a route replica re-reading the latest snapshot)."""
        self.index = index
        self.service.use_index(index)

    def forget_worker(self, worker: WorkerId) -> None:
        """A worker of a model this process no longer owns (sharded): out of the directory
        and the route service's book; its fits stay (they are small, and come back)."""
        self.directory.pop(worker, None)
        profile = self.service.book.profiles.get(worker)
        if profile is not None:
            self.service.book.apply(msgspec.structs.replace(profile, removed=True))

    def block_size_of(self, worker: WorkerId) -> int | None:
        profile = self.directory.get(worker)
        return profile.block_size if profile is not None else None

    def reports_cached_of(self, worker: WorkerId) -> bool:
        profile = self.directory.get(worker)
        return profile.reports_cached_tokens if profile is not None else True

    def on_grant(self, grant: RouteDecision, now_s: float) -> list[GradedRequest]:
        self.service.on_grant(grant, now_s)
        return self.join.on_grant(grant, now_s)

    def on_outcome(self, outcome: RequestOutcome, now_s: float) -> list[GradedRequest]:
        self.service.on_outcome(outcome, now_s)
        return self.join.on_outcome(outcome, now_s)

    def on_graded(self, graded: GradedRequest, now_s: float) -> bool:
        return self.service.on_graded(graded, now_s)

    def expire(self, now_s: float) -> list[GradedRequest]:
        """The periodic maintenance: queue models, approximate views, the join's timeout."""
        self.service.maintain(now_s)
        return self.join.expire(now_s)


def approx_config(settings: Settings) -> ApproxCacheConfig:
    worker = settings.worker
    return ApproxCacheConfig(worker.approx_cache_ttl_s, worker.approx_cache_default_tokens)


def control_settings(
    settings: Settings, controls: ControlSettings | None = None
) -> ControlSettings:
    """The controls' settings with the pending horizon capped at the router's engine timeout:
    by then the router has ended every request it sent, so an outcome that has not come is
    lost (``ControlSettings.pending_horizon_s``)."""
    base = controls or settings.controls
    cap = min(base.pending_max_age_s, settings.router.engine_timeout_s)
    return msgspec.structs.replace(
        base, pending_max_age_s=cap, pending_horizon_min_s=min(base.pending_horizon_min_s, cap)
    )


def build_core(
    settings: Settings,
    *,
    index: Index | None = None,
    predictor: PredictorConfig | None = None,
    controls: ControlSettings | None = None,
    with_controls: bool = True,
) -> ProcessorCore:
    """The processor's core from the settings (``predictor``, ``fits``, ``join``,
    ``controls``, ``worker.approx_cache_*``); ``index`` reuses one (a restored snapshot),
    ``predictor`` and ``controls`` override the settings' (a replay's seed, classes), and
    ``with_controls=False`` runs without the latency controls."""
    index = index if index is not None else settings.index.make()
    latency = LatencyControls(control_settings(settings, controls)) if with_controls else None
    service = RouteService(
        index, FitRegistry(settings.fits), predictor or settings.predictor, latency
    )
    core = ProcessorCore(
        index=index, service=service, join=GradingJoin(block_size_of=lambda w: None),
        controls=latency, approx=approx_config(settings), join_config=settings.join,
    )  # fmt: skip
    core.join = GradingJoin(
        block_size_of=core.block_size_of, timeout_s=settings.join.timeout_s,
        reports_cached_of=core.reports_cached_of, graded_memory=settings.join.graded_memory,
        max_orphans=settings.join.max_orphans,
    )  # fmt: skip
    return core
