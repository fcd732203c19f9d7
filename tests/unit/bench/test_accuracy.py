"""The accuracy harness (issue 15): one tiny cell end to end, its JSON in the stable
schema, and requests the fleet cannot hold counted as refused, not graded."""

from __future__ import annotations

import json
import math

from foretoken.bench.accuracy import POLICIES, SCHEMA, fits_everywhere, get_fleet, load_workload
from foretoken.bench.accuracy_matrix import Sizes, run_grid, table

ROW_KEYS = {"trace", "fleet", "load", "policy", "within_1s", "within_10s", "abs_error_p50_s",
            "abs_error_p95_s", "abs_error_p99_s", "under_5s", "under_10s", "under_30s",
            "p90_coverage", "disagreement", "samples", "refused", "rejected"}  # fmt: skip


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
