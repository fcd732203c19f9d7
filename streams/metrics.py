"""Prometheus metrics of the Faust worker (one registry per process, served on /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4"


class WorkerMetrics:
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

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
