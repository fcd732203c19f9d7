"""The processor's state: everything the Faust application keeps in memory, and the handlers
its agents call (decode-or-dead-letter first, in :mod:`foretoken.adapters.kafka.dispatch`).

"The processor" is foretoken's stream-processing process (``foretoken worker``: a Faust
application); "a worker" is always an engine replica. The processor's core (index, fits,
route service, latency controls, grading join) is built by :mod:`foretoken.compose`, exactly
as the virtual-time replay builds it; this module only adds what is Kafka's: offsets (the
index keeper), held acks, the lake sink, metrics, the registrations' endpoints.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from foretoken import __version__
from foretoken.adapters.http.route_page import answer_route
from foretoken.adapters.kafka.dispatch import Dispatcher, Position
from foretoken.adapters.kafka.held_acks import HeldAcks
from foretoken.adapters.kafka.index_keeper import IndexKeeper
from foretoken.adapters.kafka.lake_sink import LakeSink
from foretoken.adapters.kafka.metrics import ProcessorMetrics
from foretoken.compose import ProcessorCore, approx_config, build_core
from foretoken.core.types import WorkerId
from foretoken.settings import Settings
from foretoken.wire.records import (
    ControlEvent,
    Graded,
    Grant,
    Outcome,
    Record,
    WorkerRegistration,
    as_record,
)
from foretoken.wire.route_rpc import RouteRequest


class ProcessorState:
    def __init__(self, settings: Settings, index: IndexKeeper | None = None) -> None:
        self.settings = settings
        self.dispatcher = Dispatcher()
        self.metrics = ProcessorMetrics()
        self.started_ts = time.time()
        approx = approx_config(settings)
        self.index = index or IndexKeeper(
            settings.topic("kv_events"), None, approx=approx, config=settings.index
        )
        self.index.approx = approx
        self.core: ProcessorCore = build_core(settings, index=self.index.index)
        self.controls = self.core.controls
        # Registrations as they came: the engines' endpoints (the route page's URLs).
        self.registrations: dict[WorkerId, WorkerRegistration] = {}
        # Grants/outcomes are acked only once the join has settled their request.
        self.held_acks = HeldAcks(lambda: self.core.join.pending)
        # The graded -> Parquet lake sink, when a lake directory is configured.
        self.lake = LakeSink(settings.lake, self.metrics.registry) if settings.lake.dir else None
        self.dispatcher.on("workers", self.on_worker)
        self.dispatcher.on("workers", self.index.on_worker)
        self.dispatcher.on("kv_events", self.index.on_kv)
        self.dispatcher.on("grants", self.on_grant)
        self.dispatcher.on("outcomes", self.on_outcome)
        self.dispatcher.on("graded", self.on_graded)

    @property
    def fits(self) -> Any:
        return self.core.service.fits

    def on_worker(self, record: Record, pos: Position) -> None:
        assert isinstance(record, WorkerRegistration)
        if record.removed:
            self.registrations.pop(record.worker_id, None)
        else:
            self.registrations[record.worker_id] = record
        self.core.register(record, index=False)  # the index keeper files it in the index

    def on_grant(self, record: Record, pos: Position) -> list[tuple[str, Record]]:
        assert isinstance(record, Grant)
        return _graded(self.core.on_grant(record, time.time()))

    def on_outcome(self, record: Record, pos: Position) -> list[tuple[str, Record]]:
        assert isinstance(record, Outcome)
        return _graded(self.core.on_outcome(record, time.time()))

    def on_graded(self, record: Record, pos: Position) -> None:
        assert isinstance(record, Graded)
        self.core.on_graded(record, time.time())

    def route(self, request: RouteRequest) -> bytes:
        """``POST /v1/route``: the decision, reflected at once in the queue model."""
        return answer_route(self.core, self.registrations, request, time.time())

    def expire(self) -> list[Graded]:
        return [as_record(Graded, g) for g in self.core.expire(time.time())]

    def control_events(self) -> list[ControlEvent]:
        """Evaluate the latency controls now; their stage changes, for the ``controls``
        topic (and the metrics)."""
        controls = self.controls
        if controls is None:
            return []
        now = time.time()
        controls.tick(now)
        events = [as_record(ControlEvent, e) for e in controls.drain()]
        self.metrics.observe_controls(controls.snapshot(now), events)
        return events

    def effective_config(self) -> dict[str, Any]:
        """The configuration the running parts use (read from them, not from the settings
        object): ``/v1/config``."""
        service = self.core.service
        return msgspec.to_builtins({
            "predictor": service.config,
            "fits": service.fits.config,
            "join": {"timeout_s": self.core.join.timeout_s,
                     "expiry_interval_s": self.core.join_config.expiry_interval_s,
                     "graded_memory": self.core.join.graded_memory},
            "controls": self.controls.settings if self.controls is not None else None,
            "approx": self.index.approx,
            "index_backend": self.index.index.backend,
            "index": self.index.config,
        })  # fmt: skip

    def stats(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started_ts, 3),
            "consumed": dict(self.dispatcher.counts),
            "dead_lettered": dict(self.dispatcher.dead),
            "index_snapshots": self.index.snapshots,
            "lake": self.lake.stats() if self.lake is not None else None,
            "controls": self.controls.snapshot(time.time()) if self.controls else None,
        }


def _graded(records: list[Any]) -> list[tuple[str, Record]]:
    return [("graded", as_record(Graded, g)) for g in records]
