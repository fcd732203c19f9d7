"""The dashboard's queries (dashboards/data.py) against the grading views they must agree
with: the underpredictions and the same-side-of-bound matrix of PRODUCT.md §4 (already
waited + predicted ≤ B is the admission test; a request that failed with no first token
after B is an underprediction)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foretoken.adapters.dashboard import data
from foretoken.adapters.lake.views import connect, metric
from foretoken.adapters.lake.writer import LakeWriter
from tests.unit.adapters.lake.test_views import rec, served

ALL = data.Filters()


@pytest.mark.parametrize(
    ("record", "under"),
    [
        # a retry: waited 3 s + predicted 3 s > B = 5, never promised; actual 5.5 s
        (served("retry", "w1", 3.0, 5.5, 5.0, 0, 0, already_waited_s=3.0), 0),
        # promised (2 ≤ 5), failed with no first token after 8 s: the worst kind of miss
        (rec("failed", status="error", worker_id="w1", predicted_ttft_s=2.0, e2e_s=8.0,
             max_queue_wait_s=5.0), 1),
    ],
)  # fmt: skip
def test_every_underprediction_count_is_the_views(
    tmp_path: Path, record: object, under: int
) -> None:
    LakeWriter(tmp_path).append([record])  # type: ignore[list-item]
    with connect(tmp_path) as con:
        assert metric(con, "underpredictions")["underpredictions"] == under
        assert data.overview(con, ALL).underpredicted == under
        assert data.breakdown(con, ALL, "worker")["underpredicted"].to_list() == [under]
        assert data.bound_summary(con, ALL)["underpredicted"].to_list() == [under]


def test_the_bound_matrix_judges_the_prediction_with_the_time_already_waited(
    tmp_path: Path,
) -> None:
    LakeWriter(tmp_path).append([served("retry", "w1", 3.0, 5.5, 5.0, 0, 0, already_waited_s=3.0)])
    with connect(tmp_path) as con:
        for what_if in (False, True):
            matrix = data.bound_matrix(con, ALL, 5.0, what_if=what_if)
            assert matrix.cells[(False, False)] == 1, what_if  # late, as predicted
            assert matrix.cells[(True, False)] == 0, what_if  # not an underprediction
