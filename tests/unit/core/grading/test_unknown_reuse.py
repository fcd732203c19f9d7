"""Unknown engine reuse (issue 9): an engine that reports no cached tokens leaves the graded
record's engine reuse unknown — None, never 0 — and the cache disagreement is computed only
where both sides are known, in the join, the in-memory summary and the lake's views; the
approximate flag travels from the prediction through the grant and the graded record into
the lake; and the fit's cold samples for such engines rest on what can be known (a first
request for a never-seen prefix on an idle worker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console

from foretoken.adapters.lake.report import render, report
from foretoken.adapters.lake.views import connect, rows
from foretoken.adapters.lake.writer import write_lake
from foretoken.core.cost.fit import MIN_COLD_PROMPT_TOKENS
from foretoken.core.cost.samples import NEAR_COLD_SHARE, prefill_sample_cached, select_cold_sample
from foretoken.core.grading.grades import grade
from foretoken.core.grading.join import GradingJoin
from foretoken.core.grading.summary import summarize
from foretoken.core.index.approx import ApproxCacheConfig, index_params
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.core.types import GradedRequest, ModelName, RequestId, WorkerId
from foretoken.wire.records import Grant, Outcome, WorkerEndpoints, WorkerRegistration
from foretoken.wire.route_rpc import RouteRequest

BLOCK = 16
MODEL = ModelName("m")
TS = 1_735_689_600.0 + 10.0  # 2025-01-01T00:00:10Z


def grant(rid: str, credited: int, source: str = "events", **kw: Any) -> Grant:
    return Grant(request_id=RequestId(rid), ts=TS, model=MODEL, prompt_tokens=4096,
                 worker_id=WorkerId("w"), admitted=True, predicted_ttft_s=1.0,
                 cached_tokens=credited, cache_source=source,  # type: ignore[arg-type]
                 approximate_cache=source == "approximate", **kw)  # fmt: skip


def outcomes(rid: str, engine_cached: int | None, ttft: float = 1.2) -> tuple[Outcome, Outcome]:
    first = Outcome(request_id=RequestId(rid), ts=TS + 1, kind="first_token",
                    worker_id=WorkerId("w"), actual_ttft_s=ttft)  # fmt: skip
    done = Outcome(request_id=RequestId(rid), ts=TS + 2, kind="completion",
                   worker_id=WorkerId("w"), actual_ttft_s=ttft,
                   engine_cached_tokens=engine_cached, output_tokens=4, e2e_s=2.0)  # fmt: skip
    return first, done


def graded(rid: str, credited: int, engine: int | None, source: str = "events",
           ttft: float = 1.2, reports: bool = True) -> GradedRequest:  # fmt: skip
    first, done = outcomes(rid, engine, ttft)
    return grade(grant(rid, credited, source), first, done, lambda w: BLOCK, lambda w: reports)


# --------------------------------------------------------------------------- the join


def test_unknown_reuse_stays_unknown_and_has_no_disagreement() -> None:
    g = graded("a", 64, None, "approximate")
    assert g.engine_cached_tokens is None and g.cache_disagreement is None
    assert g.cache_source == "approximate" and g.approximate_cache
    assert g.credited_cached_tokens == 64 and g.error_s == pytest.approx(-0.2)
    known = graded("b", 64, 0)
    assert known.engine_cached_tokens == 0 and known.cache_disagreement is True
    assert known.cache_source == "events" and not known.approximate_cache


def test_a_worker_that_never_reports_has_unknown_reuse_whatever_its_outcome_says() -> None:
    g = graded("a", 0, 0, "approximate", reports=False)  # a 0 there would be a guess
    assert g.engine_cached_tokens is None and g.cache_disagreement is None
    join = GradingJoin(block_size_of=lambda w: BLOCK, reports_cached_of=lambda w: w != "w")
    join.on_grant(grant("c", 0, "approximate"), 0.0)
    first, done = outcomes("c", 0)
    join.on_outcome(first, 0.0)
    (out,) = join.on_outcome(done, 0.0)
    assert out.engine_cached_tokens is None and out.cache_disagreement is None


def test_the_summary_counts_disagreement_only_where_both_sides_are_known() -> None:
    records = [graded("a", 64, None, "approximate"), graded("b", 0, 0), graded("c", 64, 0)]
    assert summarize(records)["disagreement"] == pytest.approx(1 / 2)
    assert summarize(records[:1])["disagreement"] is None


# --------------------------------------------------------------------------- lake and views

# Golden rows (block 16; |e| = |predicted 1.0 − actual|):
#   id  source       credited  engine  actual  |e|   disagreement
#   e1  events       32        32      1.5     0.5   no
#   e2  events       64        0       3.0     2.0   yes
#   e3  events       0         None    1.2     0.2   unknown (vLLM omitted the field)
#   a1  approximate  0         None    0.5     0.5   unknown
#   a2  approximate  64        None    4.0     3.0   unknown
#   a3  approximate  48        None    1.1     0.1   unknown
GOLDEN = [
    ("e1", 32, 32, "events", 1.5), ("e2", 64, 0, "events", 3.0),
    ("e3", 0, None, "events", 1.2), ("a1", 0, None, "approximate", 0.5),
    ("a2", 64, None, "approximate", 4.0), ("a3", 48, None, "approximate", 1.1),
]  # fmt: skip


def test_lake_views_grade_unknown_reuse_and_split_by_cache_source(tmp_path: Path) -> None:
    write_lake([graded(rid, c, e, s, t) for rid, c, e, s, t in GOLDEN], tmp_path)
    con = connect(tmp_path)
    try:
        lake = {r["request_id"]: r for r in rows(con, "SELECT * FROM graded")}
        assert lake["a2"]["cache_source"] == "approximate" and lake["a2"]["approximate_cache"]
        assert lake["a2"]["engine_cached_tokens"] is None
        assert lake["a2"]["cache_disagreement"] is None
        assert lake["e2"]["cache_disagreement"] is True
        (dis,) = rows(con, "SELECT * FROM cache_disagreement")
        assert (dis["known"], dis["disagreeing"]) == (2, 1)
        assert dis["disagreement_rate"] == pytest.approx(0.5)
        src = {r["cache_source"]: r for r in rows(con, "SELECT * FROM cache_sources")}
        assert set(src) == {"events", "approximate"}
        ev, ap = src["events"], src["approximate"]
        assert (ev["served"], ev["reuse_known"], ev["reuse_unknown"]) == (3, 2, 1)
        assert (ev["disagreeing"], ev["disagreement_rate"]) == (1, pytest.approx(0.5))
        assert (ap["served"], ap["reuse_known"], ap["reuse_unknown"]) == (3, 0, 3)
        assert ap["disagreeing"] == 0 and ap["disagreement_rate"] is None
        assert ap["credited"] == 2  # a2, a3
        assert ev["within_1s"] == pytest.approx(2 / 3)  # e1, e3
        assert ap["within_1s"] == pytest.approx(2 / 3)  # a1, a3
        assert ap["abs_error_p50_s"] == pytest.approx(0.5)
    finally:
        con.close()


def test_old_lake_rows_without_the_column_count_as_events(tmp_path: Path) -> None:
    old = graded("o1", 0, 0)
    write_lake([old], tmp_path)
    con = connect(tmp_path)
    try:
        # rewrite the file without the new column, as an older build wrote it
        (part,) = tmp_path.rglob("*.parquet")
        con.execute(
            f"COPY (SELECT * EXCLUDE (cache_source) FROM read_parquet('{part}')) "
            f"TO '{part}' (FORMAT parquet)"
        )
        (row,) = rows(con, "SELECT * FROM cache_sources")
        assert row["cache_source"] == "events" and row["served"] == 1
    finally:
        con.close()


# --------------------------------------------------------------------------- end to end


def _silent_worker(index: PrefixIndex, predictor: RouteService) -> WorkerRegistration:
    reg = WorkerRegistration(
        worker_id=WorkerId("w"), model=MODEL, engine="llamacpp", engine_version="x",
        block_size=BLOCK, endpoints=WorkerEndpoints(http_url="http://w"), config_hash="c",
        ts=0.0, has_kv_events=False, reports_cached_tokens=False,
    )  # fmt: skip
    ttl, capacity = index_params(reg, ApproxCacheConfig(ttl_s=600.0))
    index.register_worker(reg.worker_id, MODEL, BLOCK, store_only_ttl_s=ttl,
                          capacity_blocks=capacity)  # fmt: skip
    predictor.on_registration(reg)
    return reg


def _serve(
    p: RouteService, rid: str, tokens: tuple[int, ...], t: float, ttft: float
) -> GradedRequest:
    """Route → grant → outcomes (the engine says nothing about reuse) → graded."""
    req = RouteRequest(request_id=RequestId(rid), model=MODEL, token_ids=tokens)
    t += TS  # one clock, as in the worker (time.time() for both)
    g = p.route(req.query(), t, t)
    p.on_grant(g, t)
    first = Outcome(request_id=g.request_id, ts=t + ttft, kind="first_token",
                    worker_id=WorkerId("w"), actual_ttft_s=ttft)  # fmt: skip
    done = Outcome(request_id=g.request_id, ts=t + ttft + 0.1, kind="completion",
                   worker_id=WorkerId("w"), actual_ttft_s=ttft, output_tokens=1,
                   e2e_s=ttft)  # fmt: skip
    p.on_outcome(first, t + ttft)
    p.on_outcome(done, t + ttft + 0.1)
    return grade(g, first, done, lambda w: BLOCK, lambda w: False)


def test_flags_travel_from_prediction_to_the_lake_and_cold_samples_are_first_requests(
    tmp_path: Path,
) -> None:
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    _silent_worker(index, p)
    shared = tuple(range(4096))
    cold = _serve(p, "r1", shared, 0.0, 0.8)
    warm = _serve(p, "r2", shared + tuple(range(9000, 9512)), 5.0, 0.2)
    other = _serve(p, "r3", tuple(range(20_000, 24_096)), 10.0, 0.8)
    assert cold.credited_cached_tokens == 0 and warm.credited_cached_tokens == 4096
    for g in (cold, warm, other):
        assert g.cache_source == "approximate" and g.approximate_cache
        assert g.engine_cached_tokens is None and g.cache_disagreement is None
    # the fit learns from the never-seen prefixes, not from the repeat (its reuse is unknown
    # and most of it was credited)
    assert [p.on_graded(g, TS + 20.0) for g in (cold, warm, other)] == [True, False, True]
    fits = p.fits.fits(WorkerId("w"))
    assert fits is not None and fits.prefill.observed == 2
    write_lake([cold, warm, other], tmp_path)
    con = connect(tmp_path)
    try:
        lake = {r["request_id"]: r for r in rows(con, "SELECT * FROM graded")}
        assert {r["cache_source"] for r in lake.values()} == {"approximate"}
        assert lake["r2"]["credited_cached_tokens"] == 4096
        (src,) = rows(con, "SELECT * FROM cache_sources")
        assert (src["served"], src["reuse_unknown"], src["credited"]) == (3, 3, 1)
    finally:
        con.close()


# --------------------------------------------------------------------------- cold samples


def _cold_candidate(**kw: Any) -> GradedRequest:
    base = graded("s", 0, None, "approximate")
    return msgspec.structs.replace(base, prompt_tokens=max(MIN_COLD_PROMPT_TOKENS, 4096), **kw)


def test_cold_sample_selection_with_unknown_reuse() -> None:
    never_seen = _cold_candidate()
    assert select_cold_sample(never_seen, others_running=False)
    assert prefill_sample_cached(never_seen, others_running=False) == 0
    # not idle: something else ran there between its grant and its first token
    assert not select_cold_sample(never_seen, others_running=True)
    assert not select_cold_sample(_cold_candidate(queue_tokens_ahead=512), others_running=False)
    # part of the prefix was routed there within the TTL: the engine may have reused it, so
    # it is not cold; a small credit (≤ 1/16 of the prompt) is a sample with that cached part
    n = _cold_candidate().prompt_tokens
    small = _cold_candidate(credited_cached_tokens=n // NEAR_COLD_SHARE)
    assert not select_cold_sample(small, others_running=False)
    assert prefill_sample_cached(small, others_running=False) == n // NEAR_COLD_SHARE
    assert prefill_sample_cached(small, others_running=True) is None
    large = _cold_candidate(credited_cached_tokens=n // NEAR_COLD_SHARE + BLOCK)
    assert prefill_sample_cached(large, others_running=False) is None
    # an engine with KV events that did not say: unknown, not a sample (unless trusted)
    silent = _cold_candidate(cache_source="events", approximate_cache=False)
    assert not select_cold_sample(silent, others_running=False)
    assert select_cold_sample(silent, others_running=False, trust_index_when_engine_silent=True)
    # a known reuse keeps the old rule
    assert select_cold_sample(_cold_candidate(engine_cached_tokens=0), others_running=False)
    reused = _cold_candidate(engine_cached_tokens=1024)
    assert not select_cold_sample(reused, others_running=False)
    assert prefill_sample_cached(reused, others_running=False) == 1024


def test_the_report_splits_by_cache_source(tmp_path: Path) -> None:
    write_lake([graded(rid, c, e, s, t) for rid, c, e, s, t in GOLDEN], tmp_path)
    summary = report(tmp_path, draws=20)
    sources = {r["cache_source"]: r for r in summary["cache_sources"]}
    assert sources["approximate"]["reuse_unknown"] == 3
    assert sources["events"]["reuse_known"] == 2
    console = Console(record=True, width=160)
    render(summary, console)
    text = console.export_text()
    assert "per cache source" in text
    line = next(ln for ln in text.splitlines() if "approximate" in ln)
    cells = [c.strip() for c in line.strip().strip("┃│").split("│")]
    # source, served, reuse known, reuse unknown, disagreement (none known), within 1 s
    assert cells == ["approximate", "3", "0", "3", "—", "66.7% of 3"]
