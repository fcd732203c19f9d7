"""Prometheus metrics of the Faust worker (one registry per process, served on /metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from foretoken.wire.records import ControlEvent

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4"


class ProcessorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.consumed = Counter(
            "foretoken_records_consumed",
            "Records decoded and handled, per logical topic.",
            ["topic"],
            registry=self.registry,
        )
        self.dead_lettered = Counter(
            "foretoken_dead_letter",
            "Records sent to the dead-letter topic, per source topic and kind of reason.",
            ["topic", "kind"],
            registry=self.registry,
        )
        self.handler_errors = Counter(
            "foretoken_handler_errors",
            "Decoded records whose handler raised (dead-lettered; the agent goes on).",
            ["topic"],
            registry=self.registry,
        )

        self.control_stage = Gauge(
            "foretoken_control_stage",
            "Latency-control stage per workload class and worker (0 ok, 1 warn, 2 reroute, "
            "3 admission).",
            ["workload_class", "worker"],
            registry=self.registry,
        )
        self.control_tail = Gauge(
            "foretoken_control_tail_queue_seconds",
            "Tail queue time (the class's percentile) over the controls' window.",
            ["workload_class", "worker"],
            registry=self.registry,
        )
        self.control_transitions = Counter(
            "foretoken_control_transitions",
            "Stage changes of the latency controls.",
            ["workload_class", "to_stage"],
            registry=self.registry,
        )
        self.worker_signal = Gauge(
            "foretoken_worker_signal",
            "Corroborating signals per worker: queue_tokens, arrival_rps, service_rps, "
            "timeouts, cancellations (over the controls' window).",
            ["worker", "signal"],
            registry=self.registry,
        )

    def observe_controls(self, snapshot: dict[str, Any], events: Sequence[ControlEvent]) -> None:
        stages = ("ok", "warn", "reroute", "admission")
        for track in snapshot["tracks"]:
            labels = (track["workload_class"], track["worker_id"])
            self.control_stage.labels(*labels).set(stages.index(track["stage"]))
            tail = track["tail_queue_s"]
            self.control_tail.labels(*labels).set(float("nan") if tail is None else tail)
        for worker, signals in snapshot["signals"].items():
            for name, value in signals.items():
                self.worker_signal.labels(worker, name).set(value)
        for event in events:
            self.control_transitions.labels(event.workload_class, event.to_stage).inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
