"""The flat summaries of ``bench index`` and ``bench route`` (issue 17): the figures a script
checks, the reference's beside them, ratios, and what counts as sustained."""

from __future__ import annotations

from typing import Any

from foretoken.bench import index_bench, route_bench


def _index_result(native: float, python: float) -> dict[str, Any]:
    lookup = {"32k_tokens": {"cpu_p50_ms": 0.1, "cpu_p99_ms": 0.2, "wall_p99_ms": 0.3}}
    return {
        "ingest": {
            "native": {"steady_stored_blocks_per_cpu_s": native, "entries": 10,
                       "steady_packed_stored_blocks_per_cpu_s": 2 * native},
            "python": {"steady_stored_blocks_per_cpu_s": python, "entries": 10},
        },
        "lookup": {"64_workers_native": lookup,
                   "64_workers_python": {"32k_tokens": {"cpu_p99_ms": 2.0}}},
        "hash": {"native_32k_us": 20.0, "python_32k_us": 400.0},
        "memory": {"native": {"bytes_per_entry": 50.0}, "python": {"bytes_per_entry": 150.0}},
        "callgrind": {"lookup_instructions_per_op": {"native": 10, "python": 100, "ratio": 10.0}},
    }  # fmt: skip


def test_the_index_summary_is_flat_with_the_reference_and_ratios() -> None:
    summary: Any = index_bench.summarize(_index_result(4e6, 2e5))
    assert summary["ingest_stored_blocks_per_cpu_s"] == 4e6
    assert summary["lookup_64w_32k_p99_ms"] == 0.2
    assert summary["hash_32k_us"] == 20.0 and summary["bytes_per_entry"] == 50.0
    assert summary["reference"]["lookup_64w_32k_p99_ms"] == 2.0
    assert summary["ratio"] == {"ingest_stored_blocks_per_cpu_s": 20.0,
                                "lookup_64w_32k_p99_ms": 10.0, "hash_32k_us": 20.0,
                                "bytes_per_entry": 3.0}  # fmt: skip
    assert all(summary["met"].values())
    assert summary["instructions"]["lookup_instructions_per_op"]["reference"] == 100
    assert not index_bench.summarize(_index_result(1e6, 2e5))["met"][
        "ingest_stored_blocks_per_cpu_s"
    ]  # type: ignore[index]


def _step(rate: float, p99: float, achieved: float, answered: int = 10) -> dict[str, Any]:
    route = {"requests": 10, "statuses": {"admitted": answered}, "p99_ms": p99,
             "achieved_rps": achieved}  # fmt: skip
    return {"rate_rps": rate, "route": route, "worker_cpu_ms_per_route_request": 1.0}


def _route_result(*steps: dict[str, Any]) -> dict[str, Any]:
    return {
        "in_process": {
            "native": {"cpu_ms_per_request_mean": 0.5, "cpu_ms_p99": 0.9, "native_walk": True},
            "python": {"cpu_ms_per_request_mean": 5.0, "cpu_ms_p99": 9.0},
        },
        "steps": list(steps),
    }


def test_the_route_summary_says_500_per_second_only_when_sustained() -> None:
    summary = route_bench.summarize(_route_result(_step(100, 3.0, 99.0), _step(500, 4.0, 490.0)))
    assert summary["route_cpu_ms_per_request"] == 0.5
    assert summary["reference"]["route_cpu_ms_per_request"] == 5.0
    assert summary["ratio"]["route_cpu_ms_per_request"] == 10.0
    assert summary["p99_ms_at_500_rps"] == 4.0 and summary["max_sustained_rps"] == 500
    behind = route_bench.summarize(_route_result(_step(100, 3.0, 99.0), _step(500, 4.0, 300.0)))
    assert behind["p99_ms_at_500_rps"] is None and behind["max_sustained_rps"] == 100
    lost = route_bench.summarize(_route_result(_step(500, 4.0, 500.0, answered=9)))
    assert lost["p99_ms_at_500_rps"] is None and lost["max_sustained_rps"] is None
    slow = route_bench.summarize(_route_result(_step(500, 250.0, 500.0)))
    assert slow["p99_ms_at_500_rps"] is None


def test_the_index_bench_runs_its_measurements_by_name_in_a_subprocess() -> None:
    """``bench index`` runs ingest and memory in fresh processes by calling them by name on
    ``index_bench``: a move of one of them to another module broke the whole bench."""
    for call in ("bench_ingest('native', 2000)", "measure_memory('native', 2000)"):
        result = index_bench._in_subprocess(call)
        assert isinstance(result, dict) and result


def test_a_full_report_carries_the_flat_summary_at_its_top(monkeypatch: Any, tmp_path: Any) -> None:
    """`foretoken bench X --json | jq .summary.Y` reads what `--summary` prints."""
    import sys
    import types

    from foretoken.bench import run as bench_run

    module: Any = types.ModuleType("fake_bench")
    module.run = lambda quick: {"detail": {"n": 3}, "summary": {"figure_ms": 1.5, "quick": quick}}
    monkeypatch.setitem(sys.modules, "fake_bench", module)
    monkeypatch.setitem(bench_run.BENCHMARKS, "fake", "fake_bench")
    monkeypatch.setattr(bench_run, "OUT_DIR", tmp_path)
    report = bench_run.run_one("fake", True)
    assert report["summary"] == {"figure_ms": 1.5, "quick": True}
    assert report["result"]["summary"] == report["summary"]
    assert (tmp_path / "fake.json").exists()
