"""The route service's RPC (``POST /v1/route``): the request the router sends, the answer
it gets back, and their translation to and from the core's values (PRODUCT.md §3).

The prompt comes as ``token_ids`` or, cheaper for long prompts (a 32k-token prompt is
~200 kB of JSON digits and ~2 ms to decode), as ``packed_token_ids``: unsigned 32-bit
little-endian ids (:func:`pack_token_ids`), a msgpack ``bin`` (base64 in JSON). The core
gets them as a numpy array (:meth:`RouteRequest.query`), never as the packed bytes.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec
import numpy as np

from foretoken.core.checks import check_finite
from foretoken.core.types import ModelName, RequestId, RouteDecision, RouteQuery
from foretoken.wire.codec import DecodeError, decode
from foretoken.wire.records import SCHEMA_VERSION, Grant, _check_version, as_record

_LE_U32: Final = np.dtype("<u4")
# Fixed limits of the format (the configurable ones are RouteLimits).
MAX_ID_CHARS: Final = 256
# A retry's request id is the client's (x-request-id, at most MAX_ID_CHARS) + "~<attempt>".
MAX_REQUEST_ID_CHARS: Final = MAX_ID_CHARS + 21
MAX_CLASS_CHARS: Final = 128
MAX_CONVERSATION_CHARS: Final = 1024
MAX_SECONDS: Final = 86_400.0  # a bound or a wait beyond a day is a mistake, not a request
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]


class RouteRequest(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /v1/route`` on the worker: one request to place."""

    request_id: Annotated[RequestId, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
    model: Annotated[ModelName, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    token_ids: tuple[TokenId, ...] = ()
    packed_token_ids: bytes = b""
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_queue_wait_s: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_SECONDS)] | None = None
    already_waited_s: Seconds = 0.0
    workload_class: Annotated[str, msgspec.Meta(max_length=MAX_CLASS_CHARS)] = "default"
    prefer_cache_hit: bool = False
    conversation_id: Annotated[str, msgspec.Meta(max_length=MAX_CONVERSATION_CHARS)] | None = None
    expected_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # vLLM's cache_salt: the engine keys the prompt's first block with it
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    # a LoRA adapter of the model: the workers that serve it, its blocks
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)
        check_finite("max_queue_wait_s", self.max_queue_wait_s)
        check_finite("already_waited_s", self.already_waited_s)
        if len(self.packed_token_ids) % 4:
            raise ValueError("packed_token_ids must be 4 bytes per token")
        if self.token_ids and self.packed_token_ids:
            raise ValueError("give token_ids or packed_token_ids, not both")
        if not self.token_ids and not self.packed_token_ids and self.prompt_tokens <= 0:
            raise ValueError("a route request carries token_ids or prompt_tokens")

    def tokens(self) -> Sequence[int] | np.ndarray:
        """The prompt's token ids, whichever way they came (empty if only a count)."""
        if self.packed_token_ids:
            return np.frombuffer(self.packed_token_ids, dtype=_LE_U32)
        return self.token_ids

    @property
    def prompt_length(self) -> int:
        if self.packed_token_ids:
            return len(self.packed_token_ids) // 4
        return len(self.token_ids) or self.prompt_tokens

    def query(self) -> RouteQuery:
        """The core's view of this request."""
        return RouteQuery(
            request_id=self.request_id, model=self.model, tokens=self.tokens(),
            prompt_tokens=self.prompt_length, max_queue_wait_s=self.max_queue_wait_s,
            already_waited_s=self.already_waited_s, workload_class=self.workload_class,
            prefer_cache_hit=self.prefer_cache_hit, conversation_id=self.conversation_id,
            expected_output_tokens=self.expected_output_tokens, cache_salt=self.cache_salt,
            lora_name=self.lora_name,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RouteLimits:
    """The configurable limits of a route request (settings ``[route]``)."""

    max_prompt_tokens: int
    max_output_tokens: int


class RouteRequestError(ValueError):
    """A route request that cannot be taken: ``status`` (4xx), the ``field`` at fault (None:
    the body as a whole) and a message naming it."""

    def __init__(self, message: str, field: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.field, self.status = message, field, status


def decode_route_request(body: bytes, limits: RouteLimits) -> RouteRequest:
    """The body as a valid :class:`RouteRequest` within ``limits``, else
    :class:`RouteRequestError` naming the field (never another exception)."""
    try:
        request = decode(body, RouteRequest)
    except DecodeError as exc:
        raise RouteRequestError(exc.reason, _field_of(exc.reason)) from exc
    n = request.prompt_length
    if n > limits.max_prompt_tokens:
        field = next(f for f in ("packed_token_ids", "token_ids", "prompt_tokens")
                     if getattr(request, f))  # fmt: skip
        raise RouteRequestError(
            f"{field}: {n} prompt tokens exceed the limit of {limits.max_prompt_tokens}", field
        )
    out = request.expected_output_tokens
    if out is not None and out > limits.max_output_tokens:
        raise RouteRequestError(
            f"expected_output_tokens: {out} exceeds the limit of {limits.max_output_tokens}",
            "expected_output_tokens",
        )
    return request


def _field_of(reason: str) -> str | None:
    """The field a msgspec message points at (``... - at `$.token_ids[3]```)."""
    marker = "- at `$."
    if marker in reason:
        path = reason.rsplit(marker, 1)[1].rstrip("`")
        return path.split("[")[0].split(".")[0] or None
    named = [(reason.find(f), f) for f in RouteRequest.__struct_fields__ if f in reason]
    return min(named)[1] if named else None  # a rule of __post_init__ names its fields


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as unsigned 32-bit little-endian bytes (``RouteRequest.packed_token_ids``)."""
    ids = array.array("I", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


class RouteResponse(msgspec.Struct, kw_only=True, frozen=True):
    """The decision (as the grant to publish) and where to send the request."""

    grant: Grant
    http_url: str | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _check_version(self.schema_version)

    @classmethod
    def of(cls, decision: RouteDecision, http_url: str | None) -> RouteResponse:
        return cls(grant=as_record(Grant, decision), http_url=http_url)
