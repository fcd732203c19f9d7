"""Grades of the attempt the prediction was for (found by a review, each on a lake with a
known answer first): the router's actual TTFT counts the time the client already waited
(a retry after a 429), the grant's prediction does not; a request that failed after its
first token still has a TTFT to grade; one that failed or was given up before it, past its
bound, is an underprediction; the router's fallback credited no cache, so it cannot
disagree with the engine."""

from __future__ import annotations

from pathlib import Path

from foretoken.adapters.lake.views import connect, metric, rows
from foretoken.adapters.lake.writer import write_lake
from foretoken.core.grading.grades import grade
from foretoken.core.types import RequestId, WorkerId
from foretoken.wire.records import Graded, Grant, Outcome, as_record

TS = 1_735_689_600.0 + 10.0
W = WorkerId("w")


def _grant(rid: str, predicted: float = 2.0, **kw: object) -> Grant:
    fields: dict[str, object] = dict(request_id=RequestId(rid), ts=TS, model="m",
                                     prompt_tokens=100, worker_id=W, admitted=True,
                                     predicted_ttft_s=predicted, max_queue_wait_s=10.0)  # fmt: skip
    return Grant(**(fields | kw))  # type: ignore[arg-type]


def _first(rid: str, ttft: float) -> Outcome:
    return Outcome(request_id=RequestId(rid), ts=TS + ttft, kind="first_token", worker_id=W,
                   actual_ttft_s=ttft)  # fmt: skip


def _done(rid: str, status: str = "ok", e2e: float = 3.0, **kw: object) -> Outcome:
    return Outcome(
        request_id=RequestId(rid),
        ts=TS + e2e,
        kind="completion",
        worker_id=W,
        status=status,
        e2e_s=e2e,
        **kw,
    )  # type: ignore[arg-type]


def _graded(grant: Grant, first: Outcome | None, done: Outcome | None) -> Graded:
    return as_record(Graded, grade(grant, first, done, lambda w: 16))


def test_a_retry_is_graded_against_its_own_prediction() -> None:
    """Waited 5 s, predicted 2 s, the attempt took 2 s (the router reports 7 s): exact."""
    g = _graded(_grant("r", already_waited_s=5.0), _first("r", 7.0), _done("r"))
    assert g.error_s == 0.0 and g.actual_ttft_s == 7.0


def test_a_first_token_then_an_error_is_still_graded() -> None:
    g = _graded(_grant("r"), _first("r", 3.0), _done("r", "error", error="engine died"))
    assert g.status == "served" and g.error_s == -1.0


def test_a_fallback_decision_credits_no_cache_so_it_cannot_disagree() -> None:
    fallback = _grant("f", predicted=None, fallback=True)  # type: ignore[arg-type]
    g = _graded(fallback, _first("f", 1.0), _done("f", engine_cached_tokens=512))
    assert g.cache_disagreement is None
    g = _graded(_grant("p", cached_tokens=0), _first("p", 1.0),
                _done("p", engine_cached_tokens=512))  # fmt: skip
    assert g.cache_disagreement is True


def test_the_views_grade_retries_and_count_misses_with_no_first_token(tmp_path: Path) -> None:
    """B = 10: a retry that waited 9 s with a 2 s prediction was never promised; one given up
    after 15 s and one failed after 60 s with no first token were promised and missed."""
    records = [
        _graded(_grant("retry", already_waited_s=9.0), _first("retry", 10.5), _done("retry")),
        _graded(_grant("gone", predicted=5.0), None, _done("gone", "cancelled", e2e=15.0)),
        _graded(_grant("died", predicted=5.0), None, _done("died", "error", e2e=60.0)),
        _graded(_grant("quick", predicted=5.0), None, _done("quick", "error", e2e=1.0)),
        _graded(_grant("late", predicted=5.0), _first("late", 12.0), _done("late", e2e=13.0)),
        _graded(_grant("fine", predicted=5.0), _first("fine", 6.0), _done("fine", e2e=7.0)),
    ]
    write_lake(records, tmp_path)
    with connect(tmp_path) as con:
        by_id = {r["request_id"]: r for r in rows(con, "SELECT * FROM graded")}
        under = metric(con, "underpredictions")
    assert by_id["retry"]["predicted_within_bound"] is False
    assert by_id["retry"]["within_1s"] is True  # error 9 + 2 - 10.5 = 0.5
    assert by_id["gone"]["underprediction"] and by_id["died"]["underprediction"]
    assert by_id["quick"]["actual_within_bound"] is None  # failed early: unknown, not a miss
    assert (under["promised"], under["underpredictions"]) == (4, 3)  # gone, died, late / +fine


def test_only_rejections_explore_samples_are_scaled_by_its_rate(tmp_path: Path) -> None:
    """B = 10: 10 explore admissions all within, 10 rejections on the prediction and 90 that
    no worker could hold (never explored): at most 10 false alarms, not 100; the dashboard
    says what the view says."""
    from foretoken.adapters.dashboard import data

    records = [
        _graded(
            _grant(f"x{i}", predicted=12.0, explore=True),
            _first(f"x{i}", 5.0),
            _done(f"x{i}", e2e=6.0),
        )
        for i in range(10)
    ]
    records += [
        _graded(
            _grant(
                f"r{i}",
                predicted=12.0,
                admitted=False,
                worker_id=None,
                reject_reason="predicted_ttft_exceeds_bound",
            ),
            None,
            None,
        )
        for i in range(10)
    ]
    records += [
        _graded(
            _grant(
                f"k{i}",
                predicted=None,
                admitted=False,
                worker_id=None,
                reject_reason="prompt_exceeds_kv_capacity",
            ),
            None,
            None,
        )
        for i in range(90)
    ]
    write_lake(records, tmp_path)
    with connect(tmp_path) as con:
        (row,) = rows(con, "SELECT * FROM false_alarms")
        dashboard = data.false_alarms(con, data.Filters())
    assert (row["rejected"], row["rejected_not_explored"]) == (10, 90)
    assert row["estimated_false_alarms"] == 10.0
    assert dashboard.explore_estimate == 10.0
