"""The grading join (pure): every grant with its outcomes into one ``GradedRequest`` record.

``grants`` and ``outcomes`` are both keyed by request id (co-partitioned), so one consumer
sees both sides of a request. Whichever side comes first waits here, keyed by request id:

* a rejected grant is graded at once (status ``rejected``: it will never have a TTFT);
* an admitted grant is graded when its ``completion`` outcome arrives (the completion carries
  the engine-reported cached tokens, the output tokens and the end-to-end time); the
  ``first_token`` outcome gives the TTFT;
* after ``timeout_s`` an admitted grant without a completion is graded with what is known
  (``served`` if its first token came, else ``missing_outcome``); outcomes whose grant never
  came are dropped and counted;
* a request id graded once is never graded again (re-delivered records are ignored).

Grades follow PRODUCT.md §4: ``error_s = predicted − actual``; cache disagreement when the
credited and engine-reported cached tokens differ by at least one block, only where both are
known (an engine that reports nothing leaves it unknown, never zero). A worker registered with
``reports_cached_tokens = false`` has unknown reuse whatever its outcomes say
(``reports_cached_of``): a 0 there would be a guess, not a measurement.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from foretoken.core.grading.grades import BlockSizeOf, ReportsCachedOf, grade, reports_always
from foretoken.core.types import GradedRequest, RequestId, RequestOutcome, RouteDecision

DEFAULT_TIMEOUT_S = 900.0
GRADED_MEMORY = 200_000  # request ids remembered as graded, for idempotency


@dataclass(frozen=True, slots=True)
class JoinConfig:
    """The grading join's timings (``[join]`` in the settings file)."""

    # An admitted grant without a completion is graded with what is known after this long.
    timeout_s: float = DEFAULT_TIMEOUT_S
    # How often the join (and the queue models) expire what waited too long.
    expiry_interval_s: float = 5.0
    graded_memory: int = GRADED_MEMORY

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or not self.expiry_interval_s > 0:
            raise ValueError("join timeout_s and expiry_interval_s must be > 0")
        if self.expiry_interval_s > self.timeout_s:
            raise ValueError("join expiry_interval_s must not exceed timeout_s")
        if self.graded_memory < 1:
            raise ValueError("join graded_memory must be >= 1")


@dataclass(slots=True)
class _Pending:
    grant: RouteDecision | None = None
    first: RequestOutcome | None = None
    completion: RequestOutcome | None = None
    since_s: float = 0.0


@dataclass
class JoinCounters:
    graded: int = 0
    duplicates: int = 0
    orphan_outcomes: int = 0
    timed_out: int = 0


@dataclass
class GradingJoin:
    block_size_of: BlockSizeOf
    timeout_s: float = DEFAULT_TIMEOUT_S
    # Whether the worker's engine reports cached tokens at all (its registration says).
    reports_cached_of: ReportsCachedOf = reports_always
    graded_memory: int = GRADED_MEMORY
    pending: dict[RequestId, _Pending] = field(default_factory=dict)
    done: OrderedDict[RequestId, None] = field(default_factory=OrderedDict)
    counters: JoinCounters = field(default_factory=JoinCounters)

    def on_grant(self, grant: RouteDecision, now_s: float) -> list[GradedRequest]:
        if grant.request_id in self.done:
            self.counters.duplicates += 1
            return []
        entry = self.pending.setdefault(grant.request_id, _Pending(since_s=now_s))
        if entry.grant is not None:
            self.counters.duplicates += 1
            return []
        entry.grant = grant
        if not grant.admitted or entry.completion is not None:
            return [self._finish(grant.request_id)]
        return []

    def on_outcome(self, outcome: RequestOutcome, now_s: float) -> list[GradedRequest]:
        if outcome.request_id in self.done:
            self.counters.duplicates += 1
            return []
        entry = self.pending.setdefault(outcome.request_id, _Pending(since_s=now_s))
        if outcome.kind == "first_token":
            entry.first = entry.first or outcome
        else:
            entry.completion = entry.completion or outcome
        if entry.completion is not None and entry.grant is not None:
            return [self._finish(outcome.request_id)]
        return []

    def expire(self, now_s: float) -> list[GradedRequest]:
        """Grade or drop what waited longer than the timeout."""
        out: list[GradedRequest] = []
        for rid in [r for r, e in self.pending.items() if now_s - e.since_s > self.timeout_s]:
            entry = self.pending[rid]
            if entry.grant is None:
                del self.pending[rid]
                self.counters.orphan_outcomes += 1
                continue
            self.counters.timed_out += 1
            out.append(self._finish(rid))
        return out

    def _finish(self, rid: RequestId) -> GradedRequest:
        entry = self.pending.pop(rid)
        assert entry.grant is not None
        self.done[rid] = None
        if len(self.done) > self.graded_memory:
            self.done.popitem(last=False)
        self.counters.graded += 1
        return grade(entry.grant, entry.first, entry.completion, self.block_size_of,
                     self.reports_cached_of)  # fmt: skip
