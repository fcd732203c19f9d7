"""The wire module: every record that crosses a foretoken topic (PRODUCT.md §2).

Records are msgspec Structs with ``schema_version``; they are encoded as JSON or msgpack
(never pickle) and validated here, at the boundary. Anything that does not decode into a
valid record raises :class:`DecodeError` with a reason, which the consumers send to the
``dead-letter`` topic. Domain code receives Structs, never raw dicts.

This module is pure (msgspec only) so that the pure core may use the record types as values.
"""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import msgspec

from foretoken.core.types import EngineBlockHash, ModelName, RequestId, WorkerId

SCHEMA_VERSION = 1
U64_MASK = (1 << 64) - 1
MAX_SEQ = (1 << 63) - 1

WireFormat = Literal["json", "msgpack"]
Tier = Literal["GPU", "CPU", "DISK", "SHARED"]
# Where a worker's cache credit comes from: the engine's own KV events (exact, unless the
# index was reset), or foretoken's own routing decisions for an engine that publishes none
# (approximate: aged by a TTL and an estimated capacity).
CacheSource = Literal["events", "approximate"]


class DecodeError(ValueError):
    """Input that is not a valid record; ``reason`` is what goes to the dead-letter topic."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Record(msgspec.Struct, kw_only=True, frozen=True):
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version < 1 or self.schema_version > SCHEMA_VERSION:
            raise ValueError(
                f"unsupported schema_version {self.schema_version} "
                f"(this build reads 1..{SCHEMA_VERSION})"
            )


def _check_u64(name: str, values: tuple[int, ...]) -> None:
    if values and (min(values) < 0 or max(values) > U64_MASK):
        raise ValueError(f"{name} must be unsigned 64-bit (normalize engine hashes first)")


def _check_finite(name: str, value: float | None, *, minimum: float | None = 0.0) -> None:
    if value is None:
        return
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


# --------------------------------------------------------------------------- workers


class SchedulerSettings(msgspec.Struct, kw_only=True, frozen=True):
    """What the engine's step scheduler does with its per-step token budget."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    # 0 = no per-request cap on a prefill chunk within a step.
    long_prefill_token_threshold: int = 0
    # False = a serial engine: one prompt prefills whole before the next starts.
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


class WorkerEndpoints(msgspec.Struct, kw_only=True, frozen=True):
    http_url: str
    kv_events_url: str | None = None
    replay_url: str | None = None
    metrics_url: str | None = None


class WorkerRegistration(Record, kw_only=True, frozen=True):
    """Topic ``workers`` (compacted, keyed by worker_id). ``removed`` retires a worker."""

    worker_id: WorkerId
    model: ModelName
    engine: str
    engine_version: str
    block_size: int
    scheduler: SchedulerSettings = SchedulerSettings()
    kv_hash_algo: str = "sha256_cbor"
    tiers: tuple[Tier, ...] = ("GPU",)
    endpoints: WorkerEndpoints
    eagle: bool = False
    # False: the engine publishes no KV events; the index credits it approximately, from the
    # prompts routed there (foretoken.core.index.approx).
    has_kv_events: bool = True
    # False: the engine never reports cached tokens; its outcomes carry None (unknown reuse).
    reports_cached_tokens: bool = True
    # KV cache capacity in GPU blocks, when the engine tells (vLLM: cache_config_info).
    gpu_blocks: int | None = None
    config_hash: str
    ts: float
    removed: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.gpu_blocks is not None and self.gpu_blocks < 1:
            raise ValueError(f"gpu_blocks must be >= 1, got {self.gpu_blocks}")
        if not self.worker_id or not self.model:
            raise ValueError("worker_id and model must be non-empty")


# --------------------------------------------------------------------------- kv-events


class BlockStored(msgspec.Struct, kw_only=True, frozen=True, tag="stored"):
    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int
    lora_name: str | None = None
    medium: Tier = "GPU"
    group_idx: int = 0
    # Only full-attention groups describe a reusable prefix; others are ignored by the index.
    full_attention: bool = True
    extra_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_u64("block_hashes", self.block_hashes)
        if self.parent_block_hash is not None:
            _check_u64("parent_block_hash", (self.parent_block_hash,))
        if self.block_size < 0:
            raise ValueError("block_size must be >= 0")


class BlockRemoved(msgspec.Struct, kw_only=True, frozen=True, tag="removed"):
    block_hashes: tuple[EngineBlockHash, ...]
    medium: Tier = "GPU"
    group_idx: int = 0

    def __post_init__(self) -> None:
        _check_u64("block_hashes", self.block_hashes)


class AllCleared(msgspec.Struct, kw_only=True, frozen=True, tag="cleared"):
    medium: Tier | None = None


class IndexReset(msgspec.Struct, kw_only=True, frozen=True, tag="reset"):
    """Written by ingest when a sequence gap could not be repaired: forget this worker."""

    reason: str


KvEvent = BlockStored | BlockRemoved | AllCleared | IndexReset


class KvEventBatch(Record, kw_only=True, frozen=True):
    """Topic ``kv-events`` (keyed by worker_id): one engine batch, normalized."""

    worker_id: WorkerId
    model: ModelName
    seq: int
    ts: float
    dp_rank: int = 0
    events: tuple[KvEvent, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.seq <= MAX_SEQ:
            raise ValueError(f"seq must be in 0..2^63-1, got {self.seq}")


# --------------------------------------------------------------------------- grants


class FitUsed(msgspec.Struct, kw_only=True, frozen=True):
    a: float
    b: float
    samples: int
    version: int
    default: bool


class CandidatePrediction(msgspec.Struct, kw_only=True, frozen=True):
    worker_id: WorkerId
    predicted_ttft_s: float
    queue_wait_s: float
    prefill_s: float
    cached_tokens: int
    cached_tier: Tier | None = None
    queue_tokens_ahead: int = 0
    approximate_cache: bool = False
    cache_source: CacheSource = "events"


class Grant(Record, kw_only=True, frozen=True):
    """Topic ``grants`` (keyed by request_id): one routing decision."""

    request_id: RequestId
    ts: float
    model: ModelName
    workload_class: str = "default"
    prompt_tokens: int
    worker_id: WorkerId | None = None
    admitted: bool
    reject_reason: str | None = None
    retry_after_s: float | None = None
    predicted_ttft_s: float | None = None
    queue_wait_s: float | None = None
    prefill_s: float | None = None
    cached_tokens: int = 0
    cached_tier: Tier | None = None
    approximate_cache: bool = False
    cache_source: CacheSource = "events"
    queue_tokens_ahead: int = 0
    fit: FitUsed | None = None
    max_queue_wait_s: float | None = None
    already_waited_s: float = 0.0
    explore: bool = False
    fallback: bool = False
    conversation_id: str | None = None
    candidates: tuple[CandidatePrediction, ...] = ()
    # Set when the latency controls moved the request off the predictor's first choice.
    rerouted_from: WorkerId | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        if self.admitted and self.worker_id is None:
            raise ValueError("an admitted grant names its worker")
        _check_finite("predicted_ttft_s", self.predicted_ttft_s)
        _check_finite("retry_after_s", self.retry_after_s)
        _check_finite("max_queue_wait_s", self.max_queue_wait_s)


# --------------------------------------------------------------------------- outcomes


class Outcome(Record, kw_only=True, frozen=True):
    """Topic ``outcomes`` (keyed by request_id): the first token, then the completion."""

    request_id: RequestId
    ts: float
    kind: Literal["first_token", "completion"]
    worker_id: WorkerId
    status: Literal["ok", "error", "cancelled"] = "ok"
    actual_ttft_s: float | None = None
    # None = the engine did not say (a miss on vLLM omits the field; some engines never say).
    engine_cached_tokens: int | None = None
    output_tokens: int | None = None
    e2e_s: float | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_finite("actual_ttft_s", self.actual_ttft_s)
        _check_finite("e2e_s", self.e2e_s)
        if self.kind == "first_token" and self.status == "ok" and self.actual_ttft_s is None:
            raise ValueError("a first_token outcome carries actual_ttft_s")


# --------------------------------------------------------------------------- graded


class Graded(Record, kw_only=True, frozen=True):
    """Topic ``graded`` (keyed by request_id): a grant joined with its outcome."""

    request_id: RequestId
    ts: float
    model: ModelName
    workload_class: str
    worker_id: WorkerId | None
    status: Literal["served", "rejected", "error", "cancelled", "missing_outcome"]
    admitted: bool
    explore: bool = False
    fallback: bool = False
    prompt_tokens: int
    predicted_ttft_s: float | None = None
    queue_wait_s: float | None = None
    prefill_s: float | None = None
    actual_ttft_s: float | None = None
    error_s: float | None = None
    credited_cached_tokens: int = 0
    # None = unknown reuse (the engine did not say); then cache_disagreement is None too.
    engine_cached_tokens: int | None = None
    block_size: int | None = None
    cache_disagreement: bool | None = None
    max_queue_wait_s: float | None = None
    already_waited_s: float = 0.0
    retry_after_s: float | None = None
    output_tokens: int | None = None
    e2e_s: float | None = None
    fit_a: float | None = None
    fit_b: float | None = None
    fit_samples: int | None = None
    fit_default: bool | None = None
    queue_tokens_ahead: int = 0
    approximate_cache: bool = False
    cache_source: CacheSource = "events"


# --------------------------------------------------------------------------- route service


class RouteRequest(Record, kw_only=True, frozen=True):
    """``POST /v1/route`` on the worker: one request to place (PRODUCT.md §3).

    The prompt comes as ``token_ids`` or, cheaper for long prompts (a 32k-token prompt is
    ~200 kB of JSON digits and ~2 ms to decode), as ``packed_token_ids``: unsigned 32-bit
    little-endian ids (see :func:`pack_token_ids`), a msgpack ``bin`` (base64 in JSON)."""

    request_id: RequestId
    model: ModelName
    token_ids: tuple[int, ...] = ()
    packed_token_ids: bytes = b""
    prompt_tokens: int = 0
    max_queue_wait_s: float | None = None
    already_waited_s: float = 0.0
    workload_class: str = "default"
    prefer_cache_hit: bool = False
    conversation_id: str | None = None
    expected_output_tokens: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_finite("max_queue_wait_s", self.max_queue_wait_s)
        _check_finite("already_waited_s", self.already_waited_s)
        if len(self.packed_token_ids) % 4:
            raise ValueError("packed_token_ids must be 4 bytes per token")
        if self.token_ids and self.packed_token_ids:
            raise ValueError("give token_ids or packed_token_ids, not both")
        if not self.token_ids and not self.packed_token_ids and self.prompt_tokens <= 0:
            raise ValueError("a route request carries token_ids or prompt_tokens")

    def tokens(self) -> Sequence[int]:
        """The prompt's token ids, whichever way they came (empty if only a count)."""
        if self.packed_token_ids:
            ids = array.array("I", self.packed_token_ids)
            if sys.byteorder == "big":
                ids.byteswap()
            return ids.tolist()
        return self.token_ids

    @property
    def prompt_length(self) -> int:
        if self.packed_token_ids:
            return len(self.packed_token_ids) // 4
        return len(self.token_ids) or self.prompt_tokens


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as unsigned 32-bit little-endian bytes (``RouteRequest.packed_token_ids``)."""
    ids = array.array("I", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


class RouteResponse(Record, kw_only=True, frozen=True):
    """The decision (as the grant to publish) and where to send the request."""

    grant: Grant
    http_url: str | None = None


# --------------------------------------------------------------------------- controls

ControlStage = Literal["ok", "warn", "reroute", "admission"]


class ControlSignals(msgspec.Struct, kw_only=True, frozen=True):
    """A worker's corroborating signals over the controls' window."""

    queue_tokens: int = 0  # prompt tokens sent there and still waiting for a first token
    peak_queue_tokens: int = 0  # the most of those at any admission in the window
    arrival_rps: float = 0.0  # admitted requests per second
    service_rps: float = 0.0  # first tokens per second
    timeouts: int = 0
    cancellations: int = 0


class ControlEvent(Record, kw_only=True, frozen=True):
    """Topic ``controls`` (keyed by worker_id): one state change of the latency controls
    for a (workload class, worker), with why: the objective, the budget left, the signals."""

    ts: float
    workload_class: str
    worker_id: WorkerId
    from_stage: ControlStage
    to_stage: ControlStage
    reason: str
    objective_ttft_s: float
    percentile: float
    queue_budget_s: float
    # The tail (at ``percentile``) of queue time over the window; None with too few samples.
    tail_queue_s: float | None = None
    remaining_budget_s: float | None = None
    threshold_s: float
    samples: int = 0
    signals: ControlSignals = ControlSignals()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.workload_class or not self.worker_id:
            raise ValueError("workload_class and worker_id must be non-empty")
        _check_finite("tail_queue_s", self.tail_queue_s)
        _check_finite("remaining_budget_s", self.remaining_budget_s, minimum=None)


# --------------------------------------------------------------------------- dead-letter


class DeadLetter(Record, kw_only=True, frozen=True):
    """Topic ``dead-letter`` (keyed by source): what could not be decoded, and why."""

    source: str
    reason: str
    ts: float
    partition: int | None = None
    offset: int | None = None
    key: bytes | None = None
    payload: bytes = b""


# --------------------------------------------------------------------------- codecs

T = TypeVar("T", bound=Record)

RECORD_TYPES: dict[str, type[Record]] = {
    "workers": WorkerRegistration,
    "kv_events": KvEventBatch,
    "grants": Grant,
    "outcomes": Outcome,
    "graded": Graded,
    "dead_letter": DeadLetter,
    "controls": ControlEvent,
}

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
_msgpack_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}


def encode(record: Record, wire_format: WireFormat = "json") -> bytes:
    if wire_format == "msgpack":
        return _msgpack_encoder.encode(record)
    return _json_encoder.encode(record)


def decode(data: bytes | None, record_type: type[T]) -> T:
    """Decode JSON or msgpack (told apart by the first byte) into a validated record."""
    if not data:
        raise DecodeError("empty payload")
    first = data[0]
    try:
        if first in (0x7B, 0x20, 0x0A, 0x0D, 0x09):  # '{' or leading whitespace: JSON
            dec = _json_decoders.get(record_type)
            if dec is None:
                dec = _json_decoders[record_type] = msgspec.json.Decoder(record_type)
            result: T = dec.decode(data)
            return result
        if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):  # a msgpack map
            mdec = _msgpack_decoders.get(record_type)
            if mdec is None:
                mdec = _msgpack_decoders[record_type] = msgspec.msgpack.Decoder(record_type)
            mresult: T = mdec.decode(data)
            return mresult
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid {record_type.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed {record_type.__name__} payload: {exc}") from exc
    except ValueError as exc:  # raised from __post_init__ checks
        raise DecodeError(f"invalid {record_type.__name__}: {exc}") from exc
    raise DecodeError(f"not a JSON object or msgpack map (first byte 0x{first:02x})")


def normalize_engine_hash(value: int | bytes | bytearray) -> EngineBlockHash:
    """Engine block hashes to unsigned 64-bit: vLLM uint64 as is, SGLang's signed int64 as
    two's complement, raw digests (vLLM's 32 bytes) by their low 8 bytes, which is how vLLM
    derives its integer form."""
    if isinstance(value, bool):
        raise DecodeError("a block hash cannot be a bool")
    if isinstance(value, int):
        if value < -(1 << 63) or value > U64_MASK:
            raise DecodeError(f"block hash {value} is outside 64 bits")
        return EngineBlockHash(value & U64_MASK)
    if isinstance(value, bytes | bytearray):
        if not value:
            raise DecodeError("empty block hash")
        return EngineBlockHash(int.from_bytes(bytes(value[-8:]), "big"))
    raise DecodeError(f"a block hash must be an int or bytes, got {type(value).__name__}")
