"""The accuracy harness (issue 15): one tiny cell end to end, its JSON in the stable
schema, and requests the fleet cannot hold counted as refused, not graded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from foretoken.bench import accuracy
from foretoken.bench.accuracy import (
    POLICIES,
    SCHEMA,
    fits_everywhere,
    get_fleet,
    load_workload,
    profile_lengths,
)
from foretoken.bench.accuracy_matrix import Sizes, run_grid, table
from foretoken.bench.predict_bench import BASELINES
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.traces import TraceRequest

ROW_KEYS = {"trace", "fleet", "load", "policy", "routing", "within_1s", "within_10s",
            "abs_error_p50_s", "abs_error_p95_s", "abs_error_p99_s", "under_5s", "under_10s",
            "under_30s", "p90_coverage", "disagreement", "samples", "refused",
            "rejected"}  # fmt: skip


def test_a_tiny_cell_grades_every_policy_in_the_stable_schema() -> None:
    sizes = Sizes(limit=40, calibration_steps=2, profile_requests=24)
    result = run_grid([("poisson-long", "small")], [1.0], sizes, limit=40, seed=0, jobs=1)
    result = json.loads(json.dumps(result))  # what --json writes
    assert result["schema"] == SCHEMA
    rows = result["cells"]
    assert [r["policy"] for r in rows] == list(POLICIES)
    for row in rows:
        assert set(row) == ROW_KEYS
        assert (row["trace"], row["fleet"], row["load"]) == ("poisson-long", "small", 1.0)
        assert row["samples"] == 40 and row["refused"] == 0
        assert 0.0 <= row["within_1s"] <= row["within_10s"] <= 1.0
        assert 0.0 <= row["abs_error_p50_s"] <= row["abs_error_p95_s"] <= row["abs_error_p99_s"]
        assert row["under_5s"] >= row["under_10s"] >= 0
    coverage = rows[0]["p90_coverage"]  # only the predictor's grants carry a p90
    assert coverage is not None and 0.0 <= coverage <= 1.0
    assert all(r["p90_coverage"] is None for r in rows[1:])
    # the baselines and the predictor predicted differently (they are not one number)
    assert len({r["abs_error_p50_s"] for r in rows}) > 1
    summary = result["summary"]
    assert all(not isinstance(v, (dict, list)) for v in summary.values())  # flat
    assert summary["cells"] == 1 and summary["rows"] == len(POLICIES)
    gap = rows[0]["within_1s"] - max(r["within_1s"] for r in rows[2:])
    assert math.isclose(summary["worst_cell_gap_1s"], gap, abs_tol=1e-4)
    assert summary["cells_predictor_ge_best_baseline_1s"] == int(gap >= 0)
    assert "| poisson-long | small | 1 |" in table(result)


def test_prompts_a_fleet_cannot_hold_are_refused_and_counted() -> None:
    small, big = get_fleet("small"), get_fleet("random-1")
    kept, refused = load_workload("mix-1k-200k", 300, small)
    assert len(kept) == 300 and refused > 0
    assert all(fits_everywhere(r, small) for r in kept)
    assert max(r.prompt_tokens for r in kept) < 10_000
    kept_big, refused_big = load_workload("mix-1k-200k", 300, big)
    assert refused_big == 0 and max(r.prompt_tokens for r in kept_big) > 150_000


def test_with_a_baseline_routing_the_predictor_is_graded_on_requests_it_did_not_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--routing``: a baseline routes, the cold predictor predicts as a read replica. Its
    predictions, made 5 s later, change its own grades and nothing else: the requests, the
    chosen workers and so the baselines' grades stay the same (a paired comparison)."""
    sizes = Sizes(limit=40, calibration_steps=2, profile_requests=24)

    def grid() -> dict[tuple[str, str], dict]:
        result = run_grid([("poisson-long", "small")], [1.0], sizes, limit=40, seed=0, jobs=1,
                          routing="least-outstanding-tokens")  # fmt: skip
        assert result["summary"]["routing"] == "least-outstanding-tokens"
        rows = json.loads(json.dumps(result))["cells"]
        assert [r["policy"] for r in rows] == ["predictor", *BASELINES]  # no profiled replica
        assert all(set(r) == ROW_KEYS and r["samples"] == 40 for r in rows)
        assert {r["routing"] for r in rows} == {"least-outstanding-tokens"}
        return {(r["policy"], r["routing"]): r for r in rows}

    plain = grid()
    predict_on = PredictorPolicy.predict_on

    def later(self: PredictorPolicy, request: object, worker_id: object) -> object:
        mine = predict_on(self, request, worker_id)  # type: ignore[arg-type]
        return None if mine is None else msgspec.structs.replace(
            mine, predicted_ttft_s=mine.predicted_ttft_s + 5.0)  # fmt: skip

    monkeypatch.setattr(PredictorPolicy, "predict_on", later)
    shifted = grid()
    key = ("predictor", "least-outstanding-tokens")
    assert shifted[key]["within_1s"] < plain[key]["within_1s"]
    assert shifted[key]["abs_error_p50_s"] > plain[key]["abs_error_p50_s"]
    for name in BASELINES:
        assert (
            shifted[(name, "least-outstanding-tokens")] == plain[(name, "least-outstanding-tokens")]
        )


def test_a_file_is_read_only_as_far_as_the_cells_and_profile_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--limit 50 on a week-long public trace read the whole file (27 M rows) for the
    offline profile; the profile now takes the requests after the cells'."""
    path = tmp_path / "t.csv"
    path.write_text("timestamp,input_length,output_length\n"
                    + "".join(f"{i},{100 + i},5\n" for i in range(1000)))  # fmt: skip
    asked: list[int | None] = []
    real = accuracy.load_azure

    def spy(source: object, **kw: Any) -> list[TraceRequest]:
        asked.append(kw.get("limit"))
        return real(source, **kw)

    monkeypatch.setattr(accuracy, "load_azure", spy)
    lengths = profile_lengths(str(path), 24, get_fleet("small"), 0, limit=40)
    assert asked == [64] and lengths == [100 + i for i in range(40, 64)]
