"""The grades of one request (PRODUCT.md §4): ``error_s = predicted − actual`` for the same
attempt — the router's actual TTFT counts the time the client already waited (a retry
after a 429), the grant's prediction does not, so ``error_s = already_waited + predicted −
actual``; cache disagreement when the credited and engine-reported cached tokens differ by
at least one block, only where both are known (an engine that reports nothing leaves it
unknown, never zero) and the grant credited something itself (the router's fallback asks no
index: its 0 is no estimate)."""

from __future__ import annotations

from collections.abc import Callable

from foretoken.core.types import GradedRequest, RequestOutcome, RouteDecision, WorkerId

BlockSizeOf = Callable[[WorkerId], int | None]
ReportsCachedOf = Callable[[WorkerId], bool]


def reports_always(worker: WorkerId) -> bool:
    return True


def _status(
    grant: RouteDecision, first: RequestOutcome | None, completion: RequestOutcome | None
) -> str:
    if not grant.admitted:
        return "rejected"
    if completion is not None and completion.status != "ok":
        if first is not None or completion.actual_ttft_s:
            return "served"  # it failed or the client left after its first token: it grades
        return completion.status
    if first is None and (completion is None or completion.actual_ttft_s is None):
        return "missing_outcome"
    return "served"


def grade(
    grant: RouteDecision,
    first: RequestOutcome | None,
    completion: RequestOutcome | None,
    block_size_of: BlockSizeOf,
    reports_cached_of: ReportsCachedOf = reports_always,
) -> GradedRequest:
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
    predicted = grant.predicted_ttft_s
    disagreement = None
    if status == "served" and engine_cached is not None and block and not grant.fallback \
            and predicted is not None:  # fmt: skip
        disagreement = abs(grant.cached_tokens - engine_cached) >= block
    fit = grant.fit
    return GradedRequest(
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
        predicted_ttft_p90_s=grant.predicted_ttft_p90_s,
        queue_wait_s=grant.queue_wait_s,
        prefill_s=grant.prefill_s,
        actual_ttft_s=actual,
        error_s=None
        if predicted is None or actual is None
        else grant.already_waited_s + predicted - actual,
        credited_cached_tokens=grant.cached_tokens,
        engine_cached_tokens=engine_cached,
        block_size=block,
        cache_disagreement=disagreement,
        max_queue_wait_s=grant.max_queue_wait_s,
        already_waited_s=grant.already_waited_s,
        retry_after_s=grant.retry_after_s,
        reject_reason=grant.reject_reason,
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
