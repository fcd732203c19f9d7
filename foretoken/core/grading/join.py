"""The grading join (pure): every grant with its outcomes into one ``GradedRequest`` record.

``grants`` and ``outcomes`` are both keyed by request id (co-partitioned), so one consumer
sees both sides of a request. Whichever side comes first waits here, keyed by request id:

* a rejected grant is graded at once (status ``rejected``: it will never have a TTFT);
* an admitted grant is graded when its ``completion`` outcome arrives (the completion carries
  the engine-reported cached tokens, the output tokens and the end-to-end time); the
  ``first_token`` outcome gives the TTFT;
* after ``timeout_s`` an admitted grant without a completion is graded with what is known
  (``served`` if its first token came, else ``missing_outcome``); outcomes whose grant never
  came are dropped and counted — after the timeout, or sooner, oldest first, once more than
  ``max_orphans`` requests have outcomes and no grant (a flood of outcomes under made-up
  request ids holds bounded memory);
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
MAX_ORPHANS = 100_000  # requests with outcomes and no grant yet, held at most


@dataclass(frozen=True, slots=True)
class JoinConfig:
    """The grading join's timings (``[join]`` in the settings file)."""

    # An admitted grant without a completion is graded with what is known after this long.
    timeout_s: float = DEFAULT_TIMEOUT_S
    # How often the join (and the queue models) expire what waited too long.
    expiry_interval_s: float = 5.0
    graded_memory: int = GRADED_MEMORY
    max_orphans: int = MAX_ORPHANS

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or not self.expiry_interval_s > 0:
            raise ValueError("join timeout_s and expiry_interval_s must be > 0")
        if self.expiry_interval_s > self.timeout_s:
            raise ValueError("join expiry_interval_s must not exceed timeout_s")
        if self.graded_memory < 1 or self.max_orphans < 1:
            raise ValueError("join graded_memory and max_orphans must be >= 1")


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
    orphans_evicted: int = 0  # of those, dropped before the timeout (max_orphans)
    timed_out: int = 0
    ungradable: int = 0  # requests whose grade was not a valid record (dropped, counted)


@dataclass
class GradingJoin:
    block_size_of: BlockSizeOf
    timeout_s: float = DEFAULT_TIMEOUT_S
    # Whether the worker's engine reports cached tokens at all (its registration says).
    reports_cached_of: ReportsCachedOf = reports_always
    graded_memory: int = GRADED_MEMORY
    max_orphans: int = MAX_ORPHANS
    pending: dict[RequestId, _Pending] = field(default_factory=dict)
    # pending requests with outcomes and no grant, oldest first
    orphans: OrderedDict[RequestId, None] = field(default_factory=OrderedDict)
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
        self.orphans.pop(grant.request_id, None)
        if not grant.admitted or entry.completion is not None:
            return self._finish(grant.request_id)
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
            return self._finish(outcome.request_id)
        if entry.grant is None:
            self.orphans[outcome.request_id] = None
            if len(self.orphans) > self.max_orphans:
                oldest, _ = self.orphans.popitem(last=False)
                del self.pending[oldest]
                self.counters.orphan_outcomes += 1
                self.counters.orphans_evicted += 1
        return []

    def expire(self, now_s: float) -> list[GradedRequest]:
        """Grade or drop what waited longer than the timeout."""
        out: list[GradedRequest] = []
        for rid in [r for r, e in self.pending.items() if now_s - e.since_s > self.timeout_s]:
            entry = self.pending[rid]
            if entry.grant is None:
                del self.pending[rid]
                self.orphans.pop(rid, None)
                self.counters.orphan_outcomes += 1
                continue
            self.counters.timed_out += 1
            out.extend(self._finish(rid))
        return out

    def _finish(self, rid: RequestId) -> list[GradedRequest]:
        """The request's grade (none when its sides do not make a valid graded record: it
        is dropped and counted, never raised into the caller, whose other requests —
        the rest of an expiry pass — would be lost with it, and an expiry timer that
        raises stops the processor)."""
        entry = self.pending.pop(rid)
        assert entry.grant is not None
        self.done[rid] = None
        if len(self.done) > self.graded_memory:
            self.done.popitem(last=False)
        try:
            graded = grade(entry.grant, entry.first, entry.completion, self.block_size_of,
                           self.reports_cached_of)  # fmt: skip
        except ValueError:
            self.counters.ungradable += 1
            return []
        self.counters.graded += 1
        return [graded]
