"""The grading join (pure): every grant with its outcomes into one ``Graded`` record.

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
from collections.abc import Callable
from dataclasses import dataclass, field

from foretoken.core.types import RequestId, WorkerId
from foretoken.wire.records import Graded, Grant, Outcome

DEFAULT_TIMEOUT_S = 900.0
GRADED_MEMORY = 200_000  # request ids remembered as graded, for idempotency

BlockSizeOf = Callable[[WorkerId], int | None]
ReportsCachedOf = Callable[[WorkerId], bool]


def _reports(worker: WorkerId) -> bool:
    return True


@dataclass(slots=True)
class _Pending:
    grant: Grant | None = None
    first: Outcome | None = None
    completion: Outcome | None = None
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
    reports_cached_of: ReportsCachedOf = _reports
    pending: dict[RequestId, _Pending] = field(default_factory=dict)
    done: OrderedDict[RequestId, None] = field(default_factory=OrderedDict)
    counters: JoinCounters = field(default_factory=JoinCounters)

    def on_grant(self, grant: Grant, now_s: float) -> list[Graded]:
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

    def on_outcome(self, outcome: Outcome, now_s: float) -> list[Graded]:
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

    def expire(self, now_s: float) -> list[Graded]:
        """Grade or drop what waited longer than the timeout."""
        out: list[Graded] = []
        for rid in [r for r, e in self.pending.items() if now_s - e.since_s > self.timeout_s]:
            entry = self.pending[rid]
            if entry.grant is None:
                del self.pending[rid]
                self.counters.orphan_outcomes += 1
                continue
            self.counters.timed_out += 1
            out.append(self._finish(rid))
        return out

    def _finish(self, rid: RequestId) -> Graded:
        entry = self.pending.pop(rid)
        assert entry.grant is not None
        self.done[rid] = None
        if len(self.done) > GRADED_MEMORY:
            self.done.popitem(last=False)
        self.counters.graded += 1
        return grade(entry.grant, entry.first, entry.completion, self.block_size_of,
                     self.reports_cached_of)  # fmt: skip


def _status(grant: Grant, first: Outcome | None, completion: Outcome | None) -> str:
    if not grant.admitted:
        return "rejected"
    if completion is not None and completion.status != "ok":
        if completion.status == "cancelled" and (first is not None or completion.actual_ttft_s):
            return "served"  # the client left after its first token: the TTFT still grades
        return completion.status
    if first is None and (completion is None or completion.actual_ttft_s is None):
        return "missing_outcome"
    return "served"


def grade(
    grant: Grant,
    first: Outcome | None,
    completion: Outcome | None,
    block_size_of: BlockSizeOf,
    reports_cached_of: ReportsCachedOf = _reports,
) -> Graded:
    status = _status(grant, first, completion)
    actual = None
    if first is not None and first.actual_ttft_s is not None:
        actual = first.actual_ttft_s
    elif completion is not None:
        actual = completion.actual_ttft_s
    if status != "served":
        actual = None
    engine_cached = completion.engine_cached_tokens if completion is not None else None
    if engine_cached is None and first is not None:
        engine_cached = first.engine_cached_tokens
    if grant.worker_id is not None and not reports_cached_of(grant.worker_id):
        engine_cached = None  # unknown reuse: the engine never says
    block = block_size_of(grant.worker_id) if grant.worker_id else None
    disagreement = None
    if status == "served" and engine_cached is not None and block:
        disagreement = abs(grant.cached_tokens - engine_cached) >= block
    predicted = grant.predicted_ttft_s
    fit = grant.fit
    return Graded(
        request_id=grant.request_id,
        ts=grant.ts,
        model=grant.model,
        workload_class=grant.workload_class,
        worker_id=grant.worker_id,
        status=status,  # type: ignore[arg-type]
        admitted=grant.admitted,
        explore=grant.explore,
        fallback=grant.fallback,
        prompt_tokens=grant.prompt_tokens,
        predicted_ttft_s=predicted,
        queue_wait_s=grant.queue_wait_s,
        prefill_s=grant.prefill_s,
        actual_ttft_s=actual,
        error_s=None if predicted is None or actual is None else predicted - actual,
        credited_cached_tokens=grant.cached_tokens,
        engine_cached_tokens=engine_cached,
        block_size=block,
        cache_disagreement=disagreement,
        max_queue_wait_s=grant.max_queue_wait_s,
        already_waited_s=grant.already_waited_s,
        retry_after_s=grant.retry_after_s,
        output_tokens=completion.output_tokens if completion is not None else None,
        e2e_s=completion.e2e_s if completion is not None else None,
        fit_a=fit.a if fit else None,
        fit_b=fit.b if fit else None,
        fit_samples=fit.samples if fit else None,
        fit_default=fit.default if fit else None,
        queue_tokens_ahead=grant.queue_tokens_ahead,
        approximate_cache=grant.approximate_cache,
        cache_source=grant.cache_source,
    )
