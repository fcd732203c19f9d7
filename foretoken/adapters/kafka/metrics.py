"""Prometheus metrics of the Faust worker (one registry per process, served on /metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from foretoken.wire.records import ControlEvent

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4"
STALENESS_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
READINESS = ("catching_up", "ok", "lagging")


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

        self.staleness = Histogram(
            "foretoken_queue_view_staleness_seconds",
            "From a decision made elsewhere (another replica) to its grant in this "
            "processor's queue model.",
            buckets=STALENESS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.outcome_delay = Histogram(
            "foretoken_outcome_delay_seconds",
            "From an outcome (first token, completion; the router's clock) to its "
            "application in this processor's queue model.",
            buckets=STALENESS_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.lag = Gauge(
            "foretoken_consumer_lag_records",
            "Records of an input topic not applied yet (end offsets minus positions, over "
            "the assigned partitions; -1 = not measured yet).",
            ["topic"], registry=self.registry,
        )  # fmt: skip
        self.readiness = Gauge(
            "foretoken_readiness",
            "1 for the current readiness (catching_up, ok, lagging), 0 for the others.",
            ["status"], registry=self.registry,
        )  # fmt: skip
        self.memory = Gauge(
            "foretoken_memory",
            "What the process holds: rss_bytes, index_blocks, queue_requests, join_pending.",
            ["kind"], registry=self.registry,
        )  # fmt: skip
        self.index_blocks = Gauge(
            "foretoken_index_blocks", "Blocks in the cache index, per model.", ["model"],
            registry=self.registry,
        )  # fmt: skip

    def observe_state(self, health: dict[str, Any], memory: dict[str, Any]) -> None:
        """Gauges from ``ProcessorState.health()`` and ``.memory()`` (taken at a scrape)."""
        for topic, lag in health["lag"].items():
            self.lag.labels(topic).set(-1 if lag is None else lag)
        status = health["status"] if health.get("caught_up", True) else "catching_up"
        for name in READINESS:
            self.readiness.labels(name).set(1 if name == status else 0)
        for kind in ("rss_bytes", "index_blocks", "queue_requests", "join_pending"):
            value = memory.get(kind)
            self.memory.labels(kind).set(float("nan") if value is None else value)
        for model, entry in memory["index_models"].items():
            self.index_blocks.labels(model).set(entry["blocks"])

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
