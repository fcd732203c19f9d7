"""The wire module: every record that crosses a foretoken topic (PRODUCT.md §2).

A record is a core value (:mod:`foretoken.core.types`) plus the envelope the wire needs: a
``schema_version`` (checked on decode) and, for registrations, the engine's endpoints. Each
record *subclasses* its value, so a decoded record is handed to the core as it is, and the
core never imports this module. Encoding and decoding are in :mod:`foretoken.wire.codec`
(JSON or msgpack, never pickle); anything that does not decode into a valid record raises
``DecodeError`` with a reason, which the consumers send to ``dead-letter``.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeVar

import msgspec

from foretoken.core.checks import check_len, check_ts
from foretoken.core.types import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    CacheSource,
    CandidatePrediction,
    ControlChange,
    ControlSignals,
    ControlStage,
    FitUsed,
    GradedRequest,
    IndexReset,
    KvBatch,
    KvEvent,
    RequestOutcome,
    RouteDecision,
    SchedulerSettings,
    Tier,
    WorkerProfile,
)

SCHEMA_VERSION: Final = 1
MAX_PARTITIONS: Final = 1 << 16  # a topic's partitions (and a member's models)
WireFormat = Literal["json", "msgpack"]

__all__ = [
    "RECORD_TYPES",
    "SCHEMA_VERSION",
    "AllCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheSource",
    "CandidatePrediction",
    "ControlEvent",
    "ControlSignals",
    "ControlStage",
    "DeadLetter",
    "FitUsed",
    "Graded",
    "Grant",
    "IndexReset",
    "KvEvent",
    "KvEventBatch",
    "Member",
    "Outcome",
    "Record",
    "SchedulerSettings",
    "Tier",
    "WireFormat",
    "WorkerEndpoints",
    "WorkerRegistration",
    "as_record",
]


def _check_version(version: int) -> None:
    if version < 1 or version > SCHEMA_VERSION:
        raise ValueError(
            f"unsupported schema_version {version} (this build reads 1..{SCHEMA_VERSION})"
        )


class WorkerEndpoints(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    http_url: str
    kv_events_url: str | None = None
    # vLLM's "replay" socket: where ingest backfills a sequence gap.
    replay_url: str | None = None
    metrics_url: str | None = None


class WorkerRegistration(WorkerProfile, kw_only=True, frozen=True):
    """Topic ``workers`` (compacted, keyed by worker_id). ``removed`` retires a worker."""

    endpoints: WorkerEndpoints
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        super().__post_init__()


class KvEventBatch(KvBatch, kw_only=True, frozen=True):
    """Topic ``kv-events`` (keyed by worker_id): one engine batch, normalized."""

    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        super().__post_init__()


class Grant(RouteDecision, kw_only=True, frozen=True):
    """Topic ``grants`` (keyed by request_id): one routing decision."""

    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        super().__post_init__()


class Outcome(RequestOutcome, kw_only=True, frozen=True):
    """Topic ``outcomes`` (keyed by request_id): the first token, then the completion."""

    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        super().__post_init__()


class Graded(GradedRequest, kw_only=True, frozen=True):
    """Topic ``graded`` (keyed by request_id): a grant joined with its outcome."""

    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        super().__post_init__()


class ControlEvent(ControlChange, kw_only=True, frozen=True):
    """Topic ``controls`` (keyed by worker_id): one state change of the latency controls."""

    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        super().__post_init__()


class DeadLetter(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Topic ``dead-letter`` (keyed by source): what could not be decoded, and why."""

    source: str
    reason: str
    ts: float
    partition: int | None = None
    offset: int | None = None
    key: bytes | None = None
    payload: bytes = b""
    # The original payload's size when ``payload`` holds only its first bytes.
    payload_size: int | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)


class Member(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Topic ``members`` (compacted, keyed by instance_id): one processor, as it advertises
    itself every ``worker.member_interval_s`` (docs/ARCHITECTURE.md "Scale-out")."""

    instance_id: str
    role: Literal["primary", "route"]
    url: str
    group: str
    sharding: Literal["none", "model"]
    # The partitions of the input topics it consumes (co-partitioned: one set for all).
    partitions: tuple[int, ...]
    # Ready to answer /v1/route (its lag under the bound); the models its index holds.
    ready: bool
    models: tuple[str, ...] = ()
    ts: float
    # A clean stop says so at once (others would otherwise wait for its record to age).
    removed: bool = False
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        check_ts("ts", self.ts)
        for name in ("instance_id", "url", "group"):
            check_len(name, getattr(self, name))
        if not self.instance_id:
            raise ValueError("instance_id must be non-empty")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http(s)://..., got {self.url[:64]!r}")
        if len(self.partitions) > MAX_PARTITIONS or any(
            not 0 <= p < MAX_PARTITIONS for p in self.partitions
        ):
            raise ValueError(f"partitions must be within 0..{MAX_PARTITIONS - 1}")
        if len(self.models) > MAX_PARTITIONS:
            raise ValueError(f"at most {MAX_PARTITIONS} models")
        for model in self.models:
            check_len("model", model)


Record = (
    WorkerRegistration | KvEventBatch | Grant | Outcome | Graded | DeadLetter | ControlEvent
    | Member
)  # fmt: skip
RECORD_TYPES: dict[str, type[Any]] = {
    "workers": WorkerRegistration,
    "kv_events": KvEventBatch,
    "grants": Grant,
    "outcomes": Outcome,
    "graded": Graded,
    "dead_letter": DeadLetter,
    "controls": ControlEvent,
    "members": Member,
}
R = TypeVar("R", bound=msgspec.Struct)


def as_record(record_type: type[R], value: msgspec.Struct, **extra: Any) -> R:
    """The wire record of a core value (the value's fields, plus ``extra``: e.g. the
    endpoints of a registration). A value that already is such a record is returned."""
    if isinstance(value, record_type) and not extra:
        return value
    fields = {f: getattr(value, f) for f in value.__struct_fields__ if f != "schema_version"}
    return record_type(**fields, **extra)
