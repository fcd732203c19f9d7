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
from typing import Final

import msgspec
import numpy as np

from foretoken.core.types import ModelName, RequestId, RouteDecision, RouteQuery, check_finite
from foretoken.wire.records import SCHEMA_VERSION, Grant, _check_version, as_record

_LE_U32: Final = np.dtype("<u4")


class RouteRequest(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /v1/route`` on the worker: one request to place."""

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
            expected_output_tokens=self.expected_output_tokens,
        )  # fmt: skip


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
