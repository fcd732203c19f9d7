"""The core's vocabulary: typed identities, enums and the values every part passes around.

Pure (msgspec only). These are *values*, not wire records: the Kafka records of
:mod:`foretoken.wire.records` are these types plus a ``schema_version`` envelope (a record
subclasses its value), so the core never imports the wire and a decoded record is a value
the core takes as it is. Invariants that make a value meaningful (an unsigned 64-bit
hash, a finite time) are checked here, on construction and on decode alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal, NewType

import msgspec
import numpy as np

from foretoken.core.checks import (
    MAX_BLOCK_SIZE,
    MAX_COUNT,
    MAX_DP_RANK,
    MAX_DURATION_S,
    MAX_ERROR_CHARS,
    MAX_LORA_ADAPTERS,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_SEQS,
    check_count,
    check_finite,
    check_group,
    check_len,
    check_part,
    check_ts,
    check_u64,
)

# --------------------------------------------------------------------------- identities

WorkerId = NewType("WorkerId", str)  # one engine replica (an entry of the `workers` topic)
RequestId = NewType("RequestId", str)
ModelName = NewType("ModelName", str)
ConversationId = NewType("ConversationId", str)
# An engine's own block hash, normalized to an unsigned 64-bit int (opaque, per engine).
EngineBlockHash = NewType("EngineBlockHash", int)
# foretoken's own chained content hash of a block (unsigned 64-bit).
ContentHash = NewType("ContentHash", int)

MAX_SEQ: Final = (1 << 63) - 1

# --------------------------------------------------------------------------- enums

Tier = Literal["GPU", "CPU", "DISK", "SHARED"]
TIERS: Final[tuple[Tier, ...]] = ("GPU", "CPU", "DISK", "SHARED")  # fastest first
LOWER_TIERS: Final[tuple[Tier, ...]] = ("CPU", "DISK", "SHARED")


class CacheSource(StrEnum):
    """Where a worker's cache credit comes from: the engine's own KV events (exact, unless
    the index was reset), foretoken's routing decisions for an engine that publishes none
    (approximate: aged by a TTL and an estimated capacity), or a prompt this service sent
    there that the engine still holds, whose KV events have not come in yet (``sent``:
    :mod:`foretoken.core.routing.sent_prefixes`)."""

    EVENTS = "events"
    APPROXIMATE = "approximate"
    SENT = "sent"


class RejectReason(StrEnum):
    """Why a request was turned away (a grant's ``reject_reason``)."""

    # The request's own prefill exceeds what its bound leaves: waiting cannot help.
    PREFILL_EXCEEDS_BOUND = "prefill_exceeds_bound"
    PREDICTED_TTFT_EXCEEDS_BOUND = "predicted_ttft_exceeds_bound"
    # No bound, but even the best worker's queue wait is past the overload limit.
    OVERLOADED = "overloaded"
    PROMPT_EXCEEDS_KV_CAPACITY = "prompt_exceeds_kv_capacity"  # no worker can hold it
    NO_WORKER_FOR_MODEL = "no_worker_for_model"
    ADMISSION_CONTROL = "admission_control"  # the latency controls shed the class


class ControlStage(StrEnum):
    """A (workload class, worker)'s stage in the latency controls, lowest first."""

    OK = "ok"
    WARN = "warn"
    REROUTE = "reroute"
    ADMISSION = "admission"


# --------------------------------------------------------------------------- workers


class SchedulerSettings(msgspec.Struct, kw_only=True, frozen=True, gc=False):
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
        check_count("max_num_batched_tokens", self.max_num_batched_tokens, MAX_PROMPT_TOKENS)
        check_count("max_num_seqs", self.max_num_seqs, MAX_SEQS)
        check_count(
            "long_prefill_token_threshold", self.long_prefill_token_threshold, MAX_PROMPT_TOKENS
        )


def unknown_scheduler_keys(scheduler: object) -> list[str]:
    """The keys of a scheduler table that :class:`SchedulerSettings` does not know (the
    struct tolerates them on the wire; a file a person writes must not: a misspelled key
    would silently leave the default in place)."""
    if not isinstance(scheduler, dict):
        return []
    return sorted(set(scheduler) - set(SchedulerSettings.__struct_fields__))


class EngineReport(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """How an engine says it runs: the part of its description that an engines file and a
    simulated fleet file share (each adds where the engine is, or its hidden truth)."""

    engine: str = "vllm"
    engine_version: str = "unknown"
    block_size: int = 16
    scheduler: SchedulerSettings = SchedulerSettings()
    kv_hash_algo: str = "sha256_cbor"
    eagle: bool = False


class WorkerProfile(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What a worker (one engine replica) says about itself: everything the predictor may
    know of it. ``removed`` retires it. (The wire's registration adds its endpoints.)"""

    worker_id: WorkerId
    model: ModelName
    engine: str
    engine_version: str
    block_size: int
    scheduler: SchedulerSettings = SchedulerSettings()
    kv_hash_algo: str = "sha256_cbor"
    tiers: tuple[Tier, ...] = ("GPU",)
    eagle: bool = False
    # False: the engine publishes no KV events; the index credits it approximately, from the
    # prompts routed there (core.index.approx).
    has_kv_events: bool = True
    # False: the engine never reports cached tokens; its outcomes carry None (unknown reuse).
    reports_cached_tokens: bool = True
    # KV cache capacity in GPU blocks, when the engine tells (vLLM: cache_config_info).
    gpu_blocks: int | None = None
    # The longest sequence (prompt + output) the engine takes (vLLM's max_model_len).
    max_model_len: int | None = None
    # The LoRA adapters it serves (the model names clients send for them).
    lora_adapters: tuple[str, ...] = ()
    config_hash: str
    ts: float
    removed: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be within 1..{MAX_BLOCK_SIZE}, got {self.block_size}"
            )
        check_ts("ts", self.ts)
        if self.gpu_blocks is not None and not 1 <= self.gpu_blocks <= MAX_COUNT:
            raise ValueError(f"gpu_blocks must be within 1..{MAX_COUNT}, got {self.gpu_blocks}")
        if self.max_model_len is not None and not 2 <= self.max_model_len <= MAX_COUNT:
            raise ValueError(
                f"max_model_len must be within 2..{MAX_COUNT}, got {self.max_model_len}"
            )
        if not self.worker_id or not self.model:
            raise ValueError("worker_id and model must be non-empty")
        for name in (
            "worker_id",
            "model",
            "engine",
            "engine_version",
            "kv_hash_algo",
            "config_hash",
        ):
            check_len(name, getattr(self, name))
        if not self.tiers or len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"tiers must be non-empty and distinct, got {list(self.tiers)}")
        if len(self.lora_adapters) > MAX_LORA_ADAPTERS:
            raise ValueError(
                f"at most {MAX_LORA_ADAPTERS} lora_adapters, got {len(self.lora_adapters)}"
            )
        for name in self.lora_adapters:
            if not name:
                raise ValueError("a lora adapter's name must be non-empty")
            check_len("lora adapter", name)

    @property
    def cache_source(self) -> CacheSource:
        return CacheSource.EVENTS if self.has_kv_events else CacheSource.APPROXIMATE

    def fits_prompt(self, prompt_tokens: int) -> bool:
        """Whether a prompt fits this worker's KV cache and context at all (when it says)."""
        return prompt_fits(prompt_tokens, self.block_size, self.gpu_blocks, self.max_model_len)


def prompt_fits(
    prompt_tokens: int, block_size: int, gpu_blocks: int | None, max_model_len: int | None
) -> bool:
    """A prompt fits a worker when its KV cache (``gpu_blocks`` × ``block_size`` tokens) and
    its context (``max_model_len``) hold it with room for one output token; an unknown
    size is no limit."""
    if gpu_blocks is not None and prompt_tokens >= gpu_blocks * block_size:
        return False
    return max_model_len is None or prompt_tokens < max_model_len


# --------------------------------------------------------------------------- kv events


class BlockStored(msgspec.Struct, kw_only=True, frozen=True, tag="stored", gc=False):
    """A store. Its prompt tokens come as ``token_ids`` or, as the ingest decoder writes
    them, ``packed_token_ids``: unsigned 32-bit little-endian ids, 4 bytes each (a msgpack
    ``bin``, base64 in JSON), which the record's decoder and the index read without a
    Python int per token. An event carries one of the two; ``tokens`` is whichever it has."""

    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None = None
    token_ids: tuple[int, ...] = ()
    packed_token_ids: bytes = b""
    block_size: int
    lora_name: str | None = None
    medium: Tier = "GPU"
    group_idx: int = 0
    # Only full-attention groups describe a reusable prefix; others are ignored by the index.
    full_attention: bool = True
    extra_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_u64("block_hashes", self.block_hashes)
        if self.parent_block_hash is not None:
            check_u64("parent_block_hash", (self.parent_block_hash,))
        if not 0 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be within 0..{MAX_BLOCK_SIZE}, got {self.block_size}"
            )
        check_group(self.group_idx)
        if len(self.packed_token_ids) % 4:
            raise ValueError("packed_token_ids must be 4 bytes per token")
        if self.token_ids and self.packed_token_ids:
            raise ValueError("give token_ids or packed_token_ids, not both")

    @property
    def tokens(self) -> tuple[int, ...] | bytes:
        """The prompt tokens as the event carries them (packed bytes or ints)."""
        return self.packed_token_ids or self.token_ids

    @property
    def token_count(self) -> int:
        return len(self.packed_token_ids) // 4 or len(self.token_ids)

    def token_id_list(self) -> list[int]:
        """The token ids as ints, whichever way they came (not for the hot path)."""
        if not self.packed_token_ids:
            return list(self.token_ids)
        return np.frombuffer(self.packed_token_ids, dtype="<u4").tolist()


class BlockRemoved(msgspec.Struct, kw_only=True, frozen=True, tag="removed", gc=False):
    block_hashes: tuple[EngineBlockHash, ...]
    medium: Tier = "GPU"
    group_idx: int = 0

    def __post_init__(self) -> None:
        check_u64("block_hashes", self.block_hashes)
        check_group(self.group_idx)


class AllCleared(msgspec.Struct, kw_only=True, frozen=True, tag="cleared", gc=False):
    medium: Tier | None = None


class IndexReset(msgspec.Struct, kw_only=True, frozen=True, tag="reset", gc=False):
    """Written by ingest: forget this worker's blocks. ``approximate`` (a gap that could not
    be repaired: the engine still holds blocks we no longer know of) flags its hits until
    the engine clears its cache; False when the engine restarted and its new stream is
    complete from seq 0 (a new process starts with an empty cache, so the index is exact)."""

    reason: str
    approximate: bool = True


KvEvent = BlockStored | BlockRemoved | AllCleared | IndexReset


class KvBatch(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One engine batch of KV events, normalized (what the cache index applies)."""

    worker_id: WorkerId
    model: ModelName
    seq: int
    ts: float
    dp_rank: int = 0
    events: tuple[KvEvent, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.seq <= MAX_SEQ:
            raise ValueError(f"seq must be in 0..2^63-1, got {self.seq}")
        check_ts("ts", self.ts)
        check_len("worker_id", self.worker_id)
        check_len("model", self.model)
        if not 0 <= self.dp_rank <= MAX_DP_RANK:
            raise ValueError(f"dp_rank must be within 0..{MAX_DP_RANK}, got {self.dp_rank}")


# --------------------------------------------------------------------------- predictions


class FitUsed(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    a: float
    b: float
    samples: int
    version: int
    default: bool


class CandidatePrediction(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One worker's prediction for a request: TTFT = queue wait + own prefill."""

    worker_id: WorkerId
    predicted_ttft_s: float
    queue_wait_s: float
    prefill_s: float
    cached_tokens: int
    cached_tier: Tier | None = None
    queue_tokens_ahead: int = 0
    approximate_cache: bool = False
    cache_source: CacheSource = CacheSource.EVENTS


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteQuery:
    """A request to place, as the route service's core sees it: its prompt as token ids (any
    sequence of ints or a numpy array; empty when only its length is known). Never on the
    wire: :mod:`foretoken.wire.route_rpc` translates the RPC into it."""

    request_id: RequestId
    model: ModelName
    tokens: Sequence[int] | np.ndarray = ()
    prompt_tokens: int = 0
    max_queue_wait_s: float | None = None
    already_waited_s: float = 0.0
    workload_class: str = "default"
    prefer_cache_hit: bool = False
    conversation_id: str | None = None
    expected_output_tokens: int | None = None
    cache_salt: str | None = None  # vLLM's: the engine keys the first block with it
    lora_name: str | None = None  # a LoRA adapter of the model (its workers, its blocks)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) or self.prompt_tokens


class RouteDecision(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One routing decision: the chosen worker (or none), admitted or rejected and why, the
    prediction it rests on and every candidate's (PRODUCT.md §2 ``grants``)."""

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
    # The calibrated 0.9-quantile of this TTFT (foretoken.core.cost.quantiles).
    predicted_ttft_p90_s: float | None = None
    queue_wait_s: float | None = None
    prefill_s: float | None = None
    cached_tokens: int = 0
    cached_tier: Tier | None = None
    approximate_cache: bool = False
    cache_source: CacheSource = CacheSource.EVENTS
    queue_tokens_ahead: int = 0
    fit: FitUsed | None = None
    max_queue_wait_s: float | None = None
    already_waited_s: float = 0.0
    explore: bool = False
    fallback: bool = False
    conversation_id: str | None = None
    # The output length the decision's queue model assumed (the client's max_tokens; None:
    # the route service's default), so that every replica models the request alike.
    expected_output_tokens: int | None = None
    candidates: tuple[CandidatePrediction, ...] = ()
    # Set when the latency controls moved the request off the predictor's first choice.
    rerouted_from: WorkerId | None = None

    def __post_init__(self) -> None:
        check_ts("ts", self.ts)
        if self.prompt_tokens > MAX_PROMPT_TOKENS:
            raise ValueError(f"prompt_tokens must be at most {MAX_PROMPT_TOKENS}")
        if self.prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        if self.admitted and self.worker_id is None:
            raise ValueError("an admitted grant names its worker")
        if self.worker_id == "" or self.rerouted_from == "":  # a control event needs one
            raise ValueError("worker_id and rerouted_from must be non-empty when given")
        if self.expected_output_tokens is not None and self.expected_output_tokens < 1:
            raise ValueError("expected_output_tokens must be >= 1")
        check_count("expected_output_tokens", self.expected_output_tokens, MAX_OUTPUT_TOKENS)
        for name in ("request_id", "model", "workload_class", "worker_id", "conversation_id",
                     "rerouted_from", "reject_reason"):  # fmt: skip
            check_len(name, getattr(self, name))
        check_count("cached_tokens", self.cached_tokens, MAX_PROMPT_TOKENS)
        check_count("queue_tokens_ahead", self.queue_tokens_ahead)
        for name in ("predicted_ttft_s", "predicted_ttft_p90_s", "retry_after_s",
                     "max_queue_wait_s", "already_waited_s"):  # fmt: skip
            check_finite(name, getattr(self, name))
        check_part("queue_wait_s", self.queue_wait_s)
        check_part("prefill_s", self.prefill_s)
        if self.already_waited_s > MAX_DURATION_S:
            raise ValueError(f"already_waited_s must be at most {MAX_DURATION_S:g} s")
        if self.fit is not None:  # the graded record checks what it carries of the fit
            check_finite("fit.a", self.fit.a, minimum=None)
            check_finite("fit.b", self.fit.b, minimum=None)
            check_count("fit.samples", self.fit.samples)


# --------------------------------------------------------------------------- outcomes


class RequestOutcome(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What the router measured of a request: its first token, then its completion."""

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
    # A decode step's time from the stream's gaps between output tokens
    # (:func:`foretoken.core.cost.samples.decode_step_s`); streams of ≥ 3 tokens only.
    decode_step_s: float | None = None

    def __post_init__(self) -> None:
        check_ts("ts", self.ts)
        check_len("request_id", self.request_id)
        check_len("worker_id", self.worker_id)
        check_len("error", self.error, MAX_ERROR_CHARS)
        check_count("engine_cached_tokens", self.engine_cached_tokens)
        check_count("output_tokens", self.output_tokens)
        for name in ("actual_ttft_s", "e2e_s", "decode_step_s"):
            value = getattr(self, name)
            check_finite(name, value)
            if value is not None and value > MAX_DURATION_S:
                raise ValueError(f"{name} must be at most {MAX_DURATION_S:g} s, got {value}")
        if self.kind == "first_token" and self.status == "ok" and self.actual_ttft_s is None:
            raise ValueError("a first_token outcome carries actual_ttft_s")


_GRADED_COUNTS: Final = (
    "prompt_tokens",
    "credited_cached_tokens",
    "engine_cached_tokens",
    "block_size",
    "output_tokens",
    "fit_samples",
    "queue_tokens_ahead",
)
GradedStatus = Literal["served", "rejected", "error", "cancelled", "missing_outcome"]


class GradedRequest(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A decision joined with its outcomes, with the grades of PRODUCT.md §4."""

    request_id: RequestId
    ts: float
    model: ModelName
    workload_class: str
    worker_id: WorkerId | None
    status: GradedStatus
    admitted: bool
    explore: bool = False
    fallback: bool = False
    prompt_tokens: int
    predicted_ttft_s: float | None = None
    predicted_ttft_p90_s: float | None = None
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
    # why it was rejected (RejectReason): only the predictor's own would-be rejections are
    # ever explored, so only they are scaled by the explore rate (false_alarms view)
    reject_reason: str | None = None
    output_tokens: int | None = None
    e2e_s: float | None = None
    fit_a: float | None = None
    fit_b: float | None = None
    fit_samples: int | None = None
    fit_default: bool | None = None
    queue_tokens_ahead: int = 0
    approximate_cache: bool = False
    cache_source: CacheSource = CacheSource.EVENTS

    def __post_init__(self) -> None:
        """A graded record comes from validated records, but the ``graded`` topic is read
        by the lake sink too: a stranger's record must not reach Parquet with a time polars
        cannot place or a NaN that skews the views' grades."""
        check_ts("ts", self.ts)
        for name in ("request_id", "model", "workload_class", "worker_id", "reject_reason"):
            check_len(name, getattr(self, name))
        for name in ("predicted_ttft_s", "predicted_ttft_p90_s", "actual_ttft_s",
                     "max_queue_wait_s", "already_waited_s", "retry_after_s", "e2e_s"):  # fmt: skip
            check_finite(name, getattr(self, name))
        check_part("queue_wait_s", self.queue_wait_s)
        check_part("prefill_s", self.prefill_s)
        for name in ("error_s", "fit_a", "fit_b"):
            check_finite(name, getattr(self, name), minimum=None)
        for name in _GRADED_COUNTS:
            check_count(name, getattr(self, name))


# --------------------------------------------------------------------------- controls


class ControlSignals(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A worker's corroborating signals over the controls' window."""

    queue_tokens: int = 0  # prompt tokens sent there and still waiting for a first token
    peak_queue_tokens: int = 0  # the most of those at any admission in the window
    arrival_rps: float = 0.0  # admitted requests per second
    service_rps: float = 0.0  # first tokens per second
    timeouts: int = 0
    cancellations: int = 0


class ControlChange(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One stage change of the latency controls for a (workload class, worker), and why:
    the objective, the budget left, the tail and the signals."""

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
        if not self.workload_class or not self.worker_id:
            raise ValueError("workload_class and worker_id must be non-empty")
        check_finite("tail_queue_s", self.tail_queue_s)
        check_finite("remaining_budget_s", self.remaining_budget_s, minimum=None)
