"""The error decomposition (`bench predict --explain`): the traced engine changes nothing,
its parts are what the engine really spent, and the predicted parts add up to the
prediction the predictor made."""

from __future__ import annotations

import pytest

from foretoken.bench.accuracy import prepare
from foretoken.bench.explain import PARTS, explain_load, summarize
from foretoken.core.types import RequestId, WorkerId
from foretoken.sim.engine import EngineModel
from foretoken.sim.replay import replay
from foretoken.sim.spec import parse_fleet
from foretoken.sim.traced import TracedEngine
from foretoken.sim.traces import TraceRequest
from tests.unit.sim.test_schedule import FLEET, _EverythingTo

A_S_PER_TOKEN = 1e-4  # FLEET's truth: no b, no overhead, no noise


def _request(i: int, at_s: float, tokens: int) -> TraceRequest:
    return TraceRequest(
        request_id=RequestId(f"r{i}"), arrival_s=at_s, prompt_tokens=tokens, output_tokens=3,
        segment_keys=(i + 1,), segment_lengths=(tokens,),
    )  # fmt: skip


def test_the_traced_engine_splits_a_wait_into_what_the_engine_spent() -> None:
    fleet = parse_fleet(FLEET)
    trace = [_request(0, 0.0, 1024), _request(1, 0.0, 1024), _request(2, 5.0, 512)]
    engines: dict[WorkerId, EngineModel] = {}
    traced = replay(trace, fleet, _EverythingTo("e-0"), progress=False,
                    engine_factory=TracedEngine, engines_out=engines).records  # fmt: skip
    plain = replay(trace, fleet, _EverythingTo("e-0"), progress=False).records
    assert traced == plain  # tracing changes nothing
    engine = engines[WorkerId("e-0")]
    assert isinstance(engine, TracedEngine)
    step_s = A_S_PER_TOKEN * 1024
    second = engine.truth_parts(RequestId("r1"))  # the whole budget went to r0 first
    assert second["prefill_ahead"] == pytest.approx(step_s)
    assert second["own"] == pytest.approx(step_s)
    assert second["ttft"] == pytest.approx(2 * step_s)
    alone = engine.truth_parts(RequestId("r2"))
    assert alone["own"] == pytest.approx(A_S_PER_TOKEN * 512)
    assert alone["prefill_ahead"] == alone["idle"] == alone["residual"] == 0.0


def test_predicted_parts_add_up_to_the_prediction_made() -> None:
    prep = prepare("poisson-long", "small", 50, 0, calibration_steps=2, profile_requests=16)
    run = explain_load((prep, 1.3))
    rows = run["records"]
    assert len(rows) == 50
    for row in rows:
        assert row["pred_ttft"] == pytest.approx(row["predicted_ttft_s"], abs=1e-9)
        assert row["true_ttft"] == pytest.approx(row["actual_ttft_s"], abs=1e-9)
        assert abs(row["pred_walk_rest"]) < 1e-6  # the walk explains the whole queue wait
        assert row["true_own"] > 0 and row["true_idle"] > -1e-9
    assert any(row["pred_prefill_ahead"] > 0 for row in rows)  # a queue formed at 1.3×
    summary = summarize(rows)
    assert set(summary) == set(PARTS)
    ttft = summary["ttft"]
    mean_error = sum(r["pred_ttft"] - r["true_ttft"] for r in rows) / len(rows)
    assert ttft["error_mean_s"] == pytest.approx(mean_error, abs=1e-3)


def test_several_loads_of_a_csv_trace_run_in_parallel_processes(tmp_path) -> None:
    """`--explain --loads a,b` over a trace read with polars: the children are spawned (a
    child forked after polars ran in the parent hung in its first polars call, forever)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "explain.json"
    subprocess.run(
        [sys.executable, "-m", "foretoken.cli", "bench", "predict", "--explain", "--trace",
         "azure-code", "--fleet", "small", "--loads", "0.8,1.0", "--limit", "30", "--jobs", "2",
         "--json", str(out)],
        check=True, timeout=180, capture_output=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert [run["load"] for run in result["runs"]] == [0.8, 1.0]
    assert len(result["records"]) == 60
