"""The replicas bench's figures from its rows (issue 19): herding counts a collision once,
only between replicas, only on workers idle in both views, only within the window; the
throughput at the p99 target interpolates where the ladder crosses it."""

from __future__ import annotations

from foretoken.bench.route_replicas import _cpu_per_request, crossed, herding, throughput_at


def test_herding_counts_cross_replica_idle_collisions_within_the_window() -> None:
    rows = [
        (0, 10.00, "w1", True), (1, 10.05, "w1", True),  # herded
        (0, 11.00, "w2", True), (0, 11.01, "w2", True),  # same replica: not herding
        (0, 12.00, "w3", True), (1, 12.50, "w3", True),  # outside the window
        (0, 13.00, "w4", False), (1, 13.01, "w4", True),  # busy in one view
        (1, 14.00, "w5", True),
    ]  # fmt: skip
    got = herding(rows, window_s=0.1)
    assert got["herded"] == 1 and got["admitted"] == 9 and got["idle_choices"] == 8
    assert got["herding_rate"] == round(1 / 9, 4)
    assert herding(rows, window_s=1.0)["herded"] == 2
    assert herding([], 0.1)["herding_rate"] is None


def _step(rps: float, p99: float) -> dict:
    return {"route": {"achieved_rps": rps, "p99_ms": p99}}


def test_throughput_at_the_target_interpolates_the_crossing() -> None:
    steps = [_step(20, 50), _step(40, 80), _step(60, 180)]
    assert throughput_at(steps, 100.0) == 44.0  # 40 + 20 * (100 - 80) / (180 - 80)
    assert throughput_at(steps[:2], 100.0) == 40.0  # never crossed: the highest measured
    assert throughput_at([_step(20, 150)], 100.0) is None
    # a ladder that never crossed gives no throughput to compare (the summary says so)
    assert crossed(steps, 100.0) and not crossed(steps[:2], 100.0)


def test_cpu_per_request_divides_each_replicas_cores_by_its_share_of_the_rate() -> None:
    windows = [{"achieved_rps": 40.0, "served": 2, "replica_cores": {0: 0.2, 1: 0.3}},
               {"achieved_rps": 40.0, "served": 1, "replica_cores": {0: 0.4, 1: 0.1}}]  # fmt: skip
    got = _cpu_per_request(windows)
    assert got == {0: 10.0, 1: 15.0}  # replica 1 did not answer in the second window
