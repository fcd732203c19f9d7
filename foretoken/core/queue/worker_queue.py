"""One worker's queue, kept from grants and outcomes (PRODUCT.md §3 "Prefill cost model
and queue replay").

:class:`WorkerQueue` holds what was sent to a worker and has not finished: each request's
send time, prompt, credited cached tokens and expected output, and whether its first
token was seen. Its life: *queued / prefilling* (the engine does not say which; the
in-flight estimate derives it) → *decoding* (first token seen) → *finished* (completion
seen, cancelled, failed, or expired because no outcome came).

Events are recorded in O(1) and applied lazily, in time order, to an
:class:`~foretoken.core.queue.inflight.InFlightEstimate` (a running simulation of the engine's
scheduler) when a prediction asks for the queue at ``now`` with the worker's current
:class:`~foretoken.core.queue.scheduler.StepCost`. ``add`` is idempotent by request id (the route
service adds at decision time; the grant that arrives later must not count twice), and
an outcome that overtakes its grant is remembered until the grant comes.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from enum import StrEnum
from operator import itemgetter
from typing import Final, TypeVar

import msgspec

from foretoken.core.queue.inflight import InFlightEstimate
from foretoken.core.queue.scheduler import (
    KvModel,
    NewRequest,
    QueuePrediction,
    QueueState,
    StepCost,
    prefill_span,
)
from foretoken.core.queue.tails import OutputTail
from foretoken.core.types import RequestId, SchedulerSettings

SNAPSHOT_VERSION: Final = 1
# Finished request ids (and first tokens that came before their grant) remembered, so a
# late grant cannot bring a finished request back.
DEFAULT_MEMORY: Final = 4096
# Pending events beyond this many per outstanding request are applied at ``expire`` (with
# the last cost a prediction used; before any, by rebuilding from the outstanding ones).
PENDING_PER_REQUEST: Final = 4

_ARRIVE: Final = 0
_FIRST_TOKEN: Final = 1
_FINISH: Final = 2
_event_order = itemgetter(0, 1)

K = TypeVar("K")
V = TypeVar("V")


class Phase(StrEnum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(slots=True)
class Outstanding:
    request_id: RequestId
    sent_at_s: float
    prompt_tokens: int
    cached_tokens: int
    expected_output_tokens: int
    first_token_s: float | None = None
    pinned_tokens: int = -1  # of the cached tokens, those another sequence holds (-1: all)
    tail: OutputTail | None = None  # its answer's length as learned (tails.py; not snapshot)


# (time, arrival number, kind, request): ordered by time, then by arrival.
_Event = tuple[float, int, int, Outstanding]


class OutstandingState(msgspec.Struct, array_like=True, frozen=True, gc=False):
    request_id: str
    sent_at_s: float
    prompt_tokens: int
    cached_tokens: int
    expected_output_tokens: int
    first_token_s: float | None = None
    pinned_tokens: int = -1  # trailing: a snapshot without it reads as "all"


class WorkerQueueState(msgspec.Struct, array_like=True, gc=False):
    version: int
    settings: SchedulerSettings
    requests: list[OutstandingState]
    finished: list[str]
    early_first_tokens: list[tuple[str, float]]


_decoder = msgspec.msgpack.Decoder(WorkerQueueState)
_encoder = msgspec.msgpack.Encoder()


class WorkerQueue:
    """The outstanding requests of one worker and the estimate of its engine's queue."""

    def __init__(
        self, settings: SchedulerSettings, *, memory: int = DEFAULT_MEMORY,
        kv: KvModel | None = None,
    ) -> None:  # fmt: skip
        self._settings = settings
        self._kv = kv  # the engine's KV capacity, when the worker reported it
        self._memory = memory
        self._requests: dict[RequestId, Outstanding] = {}
        self._decoding = 0  # of those, how many had their first token
        self._finished: dict[RequestId, None] = {}  # insertion-ordered, bounded
        self._early_first_tokens: dict[RequestId, float] = {}
        self._pending: list[_Event] = []
        self._event_count = 0
        self._estimate = InFlightEstimate(settings, kv)
        self._last_cost: StepCost | None = None

    @property
    def lag_s(self) -> float:
        """How late first tokens reach the route service (see ``InFlightEstimate.lag_s``)."""
        return self._estimate.lag_s

    @lag_s.setter
    def lag_s(self, value: float) -> None:
        self._estimate.lag_s = value

    @property
    def settings(self) -> SchedulerSettings:
        return self._settings

    def set_settings(self, settings: SchedulerSettings) -> None:
        """The worker reported other scheduler settings: re-simulate under them."""
        if settings != self._settings:
            self._settings = settings
            self._rebuild()

    # ------------------------------------------------------------------ events

    def add(
        self,
        request_id: RequestId,
        sent_at_s: float,
        prompt_tokens: int,
        cached_tokens: int,
        expected_output_tokens: int,
        pinned_tokens: int = -1,
        tail: OutputTail | None = None,
    ) -> bool:
        """A request was sent to this worker; False if it is already known.
        ``pinned_tokens``: of its cached tokens, those a sequence already there holds (the
        rest take blocks from the engine's free pool; -1: all, see ``KvModel``); ``tail``:
        its answer's length as a distribution (``tails.py``; None: the expected is exact)."""
        if request_id in self._requests or request_id in self._finished:
            return False
        entry = Outstanding(
            request_id, sent_at_s, prompt_tokens, cached_tokens, expected_output_tokens,
            pinned_tokens=pinned_tokens, tail=tail,
        )  # fmt: skip
        self._requests[request_id] = entry
        self._push(sent_at_s, _ARRIVE, entry)
        early_s = self._early_first_tokens.pop(request_id, None)
        if early_s is not None:
            entry.first_token_s = early_s
            self._decoding += 1
            self._push(early_s, _FIRST_TOKEN, entry)
        return True

    def first_token(self, request_id: RequestId, t: float) -> bool:
        """Its first token was seen at ``t``; False if unknown or already seen."""
        entry = self._requests.get(request_id)
        if entry is None:
            if request_id not in self._finished:  # the outcome overtook its grant
                _remember(self._early_first_tokens, request_id, t, self._memory)
            return False
        if entry.first_token_s is not None:
            return False
        entry.first_token_s = t
        self._decoding += 1
        self._push(t, _FIRST_TOKEN, entry)
        return True

    def finished(self, request_id: RequestId, t: float) -> bool:
        """It completed, was cancelled or failed at ``t``; False if it was not outstanding."""
        self._early_first_tokens.pop(request_id, None)
        _remember(self._finished, request_id, None, self._memory)
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        self._decoding -= entry.first_token_s is not None
        self._push(t, _FINISH, entry)
        return True

    def expire(self, now_s: float, max_age_s: float) -> list[RequestId]:
        """Forget requests sent more than ``max_age_s`` ago whose outcome never came."""
        cutoff_s = now_s - max_age_s
        expired = [rid for rid, entry in self._requests.items() if entry.sent_at_s < cutoff_s]
        for request_id in expired:
            self._decoding -= self._requests.pop(request_id).first_token_s is not None
            _remember(self._finished, request_id, None, self._memory)
            self._estimate.remove(request_id)
        if expired:
            gone = set(expired)
            self._pending = [e for e in self._pending if e[3].request_id not in gone]
        self._early_first_tokens = {
            rid: t for rid, t in self._early_first_tokens.items() if t >= cutoff_s
        }
        if len(self._pending) > PENDING_PER_REQUEST * (len(self._requests) + 1):
            if self._last_cost is None:
                self._rebuild()
            else:
                self._catch_up(now_s, self._last_cost)
        return expired

    # ------------------------------------------------------------------ predictions

    def estimate(self, now_s: float, cost: StepCost) -> QueueState:
        """The engine's queue at ``now_s`` as a replay starts from it."""
        self._catch_up(now_s, cost)
        return self._estimate.state(now_s)

    def predict(self, new_request: NewRequest, now_s: float, cost: StepCost) -> QueuePrediction:
        """TTFT of ``new_request`` sent here at ``now_s`` (see ``simulate_until_first_token``)."""
        self._catch_up(now_s, cost)
        return self._estimate.predict(new_request, now_s, cost)

    def kv_free_blocks(self, now_s: float, cost: StepCost) -> int | None:
        self._catch_up(now_s, cost)
        return self._estimate.kv_free_blocks

    def prefill_left(self, now_s: float, cost: StepCost) -> list[int]:
        """Prompt tokens each request without a first token still has to compute, as the
        estimate at ``now_s`` has it (admitted ones first, then the waiting ones in order)."""
        self._catch_up(now_s, cost)
        return self._estimate.prefill_left()

    def admission_blocked(self, now_s: float, cost: StepCost) -> bool:
        """Whether the estimate at ``now_s`` has a waiting head that cannot start."""
        self._catch_up(now_s, cost)
        return self._estimate.admission_blocked()

    def prefill_idle(self, now_s: float, cost: StepCost) -> bool:
        """Whether the estimate at ``now_s`` has no admitted prompt still prefilling."""
        self._catch_up(now_s, cost)
        return self._estimate.prefill_idle()

    def lone_head(self, now_s: float, cost: StepCost) -> RequestId | None:
        """The waiting head, if at ``now_s`` it can start and will prefill alone (the
        request behind it cannot start beside it); None otherwise."""
        self._catch_up(now_s, cost)
        key = self._estimate.lone_head()
        return RequestId(key) if isinstance(key, str) else None

    def drain_s(self, now_s: float, cost: StepCost) -> float:
        """Seconds until every prompt now queued here is prefilled (for Retry-After)."""
        self._catch_up(now_s, cost)
        return self._estimate.drain_s(now_s, cost)

    # ------------------------------------------------------------------ counters

    @property
    def outstanding_count(self) -> int:
        return len(self._requests)

    @property
    def decoding_count(self) -> int:
        """Requests whose first token was seen and whose completion was not."""
        return self._decoding

    @property
    def unstarted_count(self) -> int:
        """Requests whose first token was not seen yet (waiting or prefilling)."""
        return len(self._requests) - self._decoding

    def first_unstarted_sent(self, since_s: float, skip: Container[RequestId]) -> float | None:
        """When the first request (in the order sent) sent at or after ``since_s``, not in
        ``skip`` and without a first token seen yet was sent; None if there is none."""
        for e in self._requests.values():
            if e.first_token_s is None and e.sent_at_s >= since_s and e.request_id not in skip:
                return e.sent_at_s
        return None

    def waiting_sent_before(self, t: float, request_id: RequestId) -> bool:
        """Whether a request other than ``request_id``, sent before ``t``, has not had
        its first token seen yet (it is still waiting or prefilling)."""
        return any(
            e.first_token_s is None and e.sent_at_s < t and e.request_id != request_id
            for e in self._requests.values()
        )

    @property
    def running_count(self) -> int:
        """Requests the engine is estimated to run (prefilling or decoding), as of the
        last estimate, plus decoding requests it has not yet taken in."""
        in_estimate = self._estimate.running_count
        return in_estimate + sum(
            1
            for e in self._requests.values()
            if e.first_token_s is not None and e.request_id not in self._estimate
        )

    @property
    def queued_tokens_ahead(self) -> int:
        """Prompt tokens not yet prefilled, as of the last estimate (a request it has not
        taken in counts whole; one without a first token counts at least one chunk)."""
        total = 0
        for entry in self._requests.values():
            if entry.first_token_s is not None:
                continue
            left = self._estimate.prefill_tokens_left(entry.request_id)
            if left is None:
                first, prompt = prefill_span(entry.prompt_tokens, entry.cached_tokens)
                left = prompt - first
            total += left
        return total

    def phase(self, request_id: RequestId) -> Phase | None:
        entry = self._requests.get(request_id)
        if entry is None:
            return Phase.FINISHED if request_id in self._finished else None
        if entry.first_token_s is not None:
            return Phase.DECODING
        estimated = self._estimate.phase(request_id)
        return Phase.PREFILLING if estimated == "prefilling" else Phase.QUEUED

    def outstanding(self) -> list[Outstanding]:
        return list(self._requests.values())

    @property
    def kv(self) -> KvModel | None:
        return self._kv

    def unstarted_sent_since(self, t: float) -> list[Outstanding]:
        """The requests sent at or after ``t`` without a first token seen, by send time."""
        found = [e for e in self._requests.values() if e.first_token_s is None and e.sent_at_s >= t]
        return sorted(found, key=lambda e: e.sent_at_s)

    def get(self, request_id: RequestId) -> Outstanding | None:
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ state

    def snapshot(self) -> bytes:
        """The bookkeeping as msgpack; :meth:`restore` re-simulates the engine from it."""
        state = WorkerQueueState(
            version=SNAPSHOT_VERSION,
            settings=self._settings,
            requests=[
                OutstandingState(
                    e.request_id,
                    e.sent_at_s,
                    e.prompt_tokens,
                    e.cached_tokens,
                    e.expected_output_tokens,
                    e.first_token_s,
                    e.pinned_tokens,
                )
                for e in self._requests.values()
            ],
            finished=list(self._finished),
            early_first_tokens=list(self._early_first_tokens.items()),
        )
        return _encoder.encode(state)

    @classmethod
    def restore(
        cls, data: bytes, *, memory: int = DEFAULT_MEMORY, kv: KvModel | None = None
    ) -> WorkerQueue:
        state = _decoder.decode(data)
        if state.version != SNAPSHOT_VERSION:
            raise ValueError(
                f"snapshot version {state.version}, this build reads {SNAPSHOT_VERSION}"
            )
        queue = cls(state.settings, memory=memory, kv=kv)
        for item in state.requests:
            rid = RequestId(item.request_id)
            queue._requests[rid] = Outstanding(
                rid,
                item.sent_at_s,
                item.prompt_tokens,
                item.cached_tokens,
                item.expected_output_tokens,
                item.first_token_s,
                item.pinned_tokens,
            )
            queue._decoding += item.first_token_s is not None
        queue._finished = dict.fromkeys(RequestId(rid) for rid in state.finished)
        queue._early_first_tokens = {RequestId(r): t for r, t in state.early_first_tokens}
        queue._rebuild()
        return queue

    # ------------------------------------------------------------------ internals

    def _push(self, t: float, kind: int, entry: Outstanding) -> None:
        self._pending.append((t, self._event_count, kind, entry))
        self._event_count += 1

    def _catch_up(self, now_s: float, cost: StepCost) -> None:
        """Apply pending events in time order (late ones as corrections, future ones at
        ``now_s``), then simulate the engine up to ``now_s``."""
        self._last_cost = cost
        estimate = self._estimate
        if self._pending:
            self._pending.sort(key=_event_order)
            for t, _, kind, entry in self._pending:
                at_s = min(t, now_s)
                estimate.advance(at_s, cost)
                if kind == _ARRIVE:
                    estimate.arrive(
                        entry.request_id,
                        at_s,
                        entry.prompt_tokens,
                        entry.cached_tokens,
                        entry.expected_output_tokens,
                        entry.pinned_tokens,
                        entry.tail,
                    )
                elif kind == _FIRST_TOKEN:
                    estimate.first_token(entry.request_id, at_s)
                else:
                    estimate.remove(entry.request_id)
            self._pending.clear()
        estimate.advance(now_s, cost)

    def reestimate(
        self, expected: Callable[[RequestId], int | None],
        tail: Callable[[RequestId], OutputTail | None] | None = None,
    ) -> bool:  # fmt: skip
        """New expected output lengths for the outstanding requests (None: keep one's),
        and with ``tail`` their tails where they had none: the estimate is replayed afresh
        when any changed."""
        changed = False
        for entry in self._requests.values():
            new = expected(entry.request_id)
            if new is not None and new != entry.expected_output_tokens:
                entry.expected_output_tokens = new
                changed = True
            if tail is not None and entry.tail is None:
                entry.tail = tail(entry.request_id)
                changed = changed or entry.tail is not None
        if changed:
            self._rebuild()
        return changed

    def _rebuild(self) -> None:
        """Start the estimate afresh: replay every outstanding request from its send time,
        with the first tokens seen."""
        lag_s = self._estimate.lag_s
        self._estimate = InFlightEstimate(self._settings, self._kv)
        self._estimate.lag_s = lag_s
        self._pending = []
        for entry in sorted(self._requests.values(), key=lambda e: e.sent_at_s):
            self._push(entry.sent_at_s, _ARRIVE, entry)
            if entry.first_token_s is not None:
                self._push(entry.first_token_s, _FIRST_TOKEN, entry)


def _remember(memory: dict[K, V], key: K, value: V, limit: int) -> None:
    """Insert into a bounded insertion-ordered dict, dropping the oldest entries."""
    memory[key] = value
    while len(memory) > limit:
        del memory[next(iter(memory))]
