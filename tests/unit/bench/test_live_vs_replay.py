"""bench live-vs-replay's grading: both sides on the requests served on both, split by
each side's own prediction state (the live stack itself runs in the bench, not here)."""

from __future__ import annotations

from typing import Any

import pytest

from foretoken.bench.live_vs_replay import compare, workload


def _row(rid: str, pred: float, act: float | None, *, default: bool = False,
         wait: float = 0.0, status: str = "served") -> dict[str, Any]:  # fmt: skip
    return {
        "request_id": rid,
        "status": status,
        "predicted_ttft_s": pred,
        "actual_ttft_s": act,
        "predicted_ttft_p90_s": pred * 2,
        "fit_default": default,
        "queue_wait_s": wait,
    }


def test_both_sides_are_graded_on_the_requests_served_on_both() -> None:
    live = [_row("a", 1.0, 1.5), _row("b", 1.0, 3.0, default=True, wait=1.0),
            _row("c", 1.0, None, status="rejected")]  # fmt: skip
    replay = [_row("a", 1.0, 1.1), _row("b", 2.5, 3.0, wait=1.0), _row("c", 1.0, 1.0),
              _row("d", 1.0, 1.0)]  # fmt: skip
    out = compare(live, replay)
    assert out["served_live"] == 2 and out["served_replay"] == 4 and out["served_both"] == 2
    assert out["live"]["within_1s"] == pytest.approx(0.5)  # b is 2 s off live
    assert out["replay"]["within_1s"] == pytest.approx(1.0)
    assert out["live"]["p90_coverage"] == pytest.approx(0.5)  # b: 3.0 > 2·1.0
    assert out["by"]["default_curve"]["live"]["served"] == 1
    assert out["by"]["default_curve"]["replay"] == {"served": 0}
    assert out["by"]["queued"]["replay"]["served"] == 1


def test_the_workload_caps_outputs_and_draws_bounds() -> None:
    requests = workload(20.0)
    assert requests and all(r.output_tokens <= 16 for r in requests)
    assert {r.max_queue_wait_s for r in requests} >= {10.0, 30.0, None}
