from __future__ import annotations

from foretoken.core.grading.join import GradingJoin
from foretoken.wire.records import FitUsed, Grant, Outcome

BLOCK = 16


def _join() -> GradingJoin:
    return GradingJoin(block_size_of=lambda w: BLOCK if w else None, timeout_s=100.0)


def _grant(rid: str = "r1", admitted: bool = True, cached: int = 32, **kw: object) -> Grant:
    fields: dict = dict(  # type: ignore[type-arg]
        request_id=rid, ts=1000.0, model="m", prompt_tokens=512, admitted=admitted,
        worker_id="w1" if admitted else None, predicted_ttft_s=2.0 if admitted else None,
        cached_tokens=cached, max_queue_wait_s=10.0,
        fit=FitUsed(a=1e-5, b=1e-10, samples=12, version=1, default=False),
    )  # fmt: skip
    fields.update(kw)
    return Grant(**fields)


def _first(rid: str = "r1", ttft: float = 2.5) -> Outcome:
    return Outcome(request_id=rid, ts=1, kind="first_token", worker_id="w1", actual_ttft_s=ttft)


def _done(rid: str = "r1", cached: int | None = 32, status: str = "ok") -> Outcome:
    return Outcome(request_id=rid, ts=2, kind="completion", worker_id="w1", status=status,
                   engine_cached_tokens=cached, output_tokens=7, e2e_s=3.0,
                   actual_ttft_s=2.5 if status != "error" else None)  # type: ignore[arg-type]  # fmt: skip


def test_served_request_is_graded_once_with_its_error_and_agreement() -> None:
    j = _join()
    assert j.on_grant(_grant(), 0) == []
    assert j.on_outcome(_first(), 1) == []
    (g,) = j.on_outcome(_done(), 2)
    assert g.status == "served" and g.actual_ttft_s == 2.5
    assert g.error_s == -0.5  # predicted − actual
    assert g.cache_disagreement is False and g.engine_cached_tokens == 32
    assert g.output_tokens == 7 and g.fit_samples == 12
    # re-delivered records never grade twice
    assert j.on_outcome(_done(), 3) == [] and j.on_grant(_grant(), 3) == []
    assert j.counters.duplicates == 2


def test_outcomes_before_the_grant_wait_for_it() -> None:
    j = _join()
    j.on_outcome(_first(), 0)
    assert j.on_outcome(_done(cached=0), 0) == []
    (g,) = j.on_grant(_grant(cached=64), 1)
    assert g.cache_disagreement is True  # 64 credited, 0 reused: 4 blocks apart


def test_disagreement_needs_a_whole_block_and_a_known_engine_side() -> None:
    j = _join()
    j.on_grant(_grant("a", cached=32), 0)
    j.on_outcome(_first("a"), 0)
    (g,) = j.on_outcome(_done("a", cached=32 + BLOCK - 1), 0)
    assert g.cache_disagreement is False
    j.on_grant(_grant("b"), 0)
    j.on_outcome(_first("b"), 0)
    (g,) = j.on_outcome(_done("b", cached=None), 0)
    assert g.engine_cached_tokens is None and g.cache_disagreement is None


def test_rejections_grade_at_once_and_timeouts_grade_what_is_known() -> None:
    j = _join()
    (r,) = j.on_grant(_grant("rej", admitted=False, retry_after_s=3.0), 0)
    assert r.status == "rejected" and r.actual_ttft_s is None and r.retry_after_s == 3.0
    j.on_grant(_grant("lost"), 0)
    j.on_grant(_grant("half"), 0)
    j.on_outcome(_first("half", ttft=4.0), 0)
    j.on_outcome(_first("orphan"), 0)
    assert j.expire(50) == []
    graded = {g.request_id: g for g in j.expire(101)}
    assert graded["lost"].status == "missing_outcome" and graded["lost"].error_s is None
    assert graded["half"].status == "served" and graded["half"].error_s == -2.0
    assert j.counters.orphan_outcomes == 1 and not j.pending


def test_engine_errors_are_not_graded_as_served() -> None:
    j = _join()
    j.on_grant(_grant(), 0)
    (g,) = j.on_outcome(_done(status="error", cached=None), 0)
    assert g.status == "error" and g.error_s is None


def test_outcomes_without_a_grant_are_held_within_a_bound_oldest_dropped_first() -> None:
    j = GradingJoin(block_size_of=lambda w: BLOCK, timeout_s=100.0, max_orphans=3)
    for i in range(5):  # a flood under made-up ids
        j.on_outcome(_first(f"x{i}"), 0)
    assert set(j.pending) == {"x2", "x3", "x4"} and list(j.orphans) == ["x2", "x3", "x4"]
    assert j.counters.orphan_outcomes == 2 and j.counters.orphans_evicted == 2
    # a real request whose grant comes late is still joined while it is among the newest
    j.on_outcome(_first("r1"), 1)
    j.on_outcome(_done("r1"), 1)
    (g,) = j.on_grant(_grant("r1"), 2)
    assert g.status == "served" and "r1" not in j.orphans
    assert j.expire(200.0) == [] and j.pending == {} and not j.orphans
