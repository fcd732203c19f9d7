"""Virtual-time replay (fleet/replay.py) against hand-computed TTFTs, plus the lake, the
summary, determinism and the equivalence of decode runs with plain stepping.

The toy fleet: two engines, a = 1 ms/token, b = 0, step overhead 10 ms, decode 2 ms per
sequence, no noise, budget 100 tokens, block size 4 — a step's duration reads off its
chunks. The four requests:

* r0: 40 fresh tokens at 0.00 s, 2 output tokens;
* r1: 60 fresh tokens at 0.00 s, 1 output token;
* r2: 20 fresh tokens at 0.02 s, 1 output token;
* r3: r1's 60 tokens + 8 fresh ones at 1.00 s, 1 output token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.sim.policy import (
    Arrival,
    Decision,
    FinishedSeen,
    FirstTokenSeen,
    FleetLedger,
    FleetView,
    IgnoresFeedback,
    LeastOutstandingTokens,
    RoundRobin,
    RoutingPolicy,
)
from foretoken.sim.prefix_cache import KvEventDetail
from foretoken.sim.replay import (
    EPOCH_BASE_TS,
    capacity_speedup,
    graded_schema,
    replay,
    run_replay,
    summary,
    write_lake,
)
from foretoken.sim.spec import EngineSpec, FleetSpec, KvCapacity, TruthSpec
from foretoken.sim.traces import LengthDistribution, SharingModel, TraceRequest, synthetic_requests
from foretoken.wire.records import BlockStored, Graded, KvEvent, SchedulerSettings

BLOCK = 4


def toy_engine(worker: str, *, gpu_blocks: int = 1000, **truth: float) -> EngineSpec:
    costs: dict[str, float] = {
        "prefill_a_s_per_token": 1e-3,
        "prefill_b_s_per_token2": 0.0,
        "step_overhead_s": 0.01,
        "decode_s_per_seq": 0.002,
        **truth,
    }
    seed = int(costs.pop("seed", 0))
    cpu_blocks = int(costs.pop("cpu_blocks", 0))
    return EngineSpec(
        id=WorkerId(worker),
        model=ModelName("toy"),
        block_size=BLOCK,
        kv=KvCapacity(gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks),
        scheduler=SchedulerSettings(max_num_batched_tokens=100, max_num_seqs=8),
        truth=TruthSpec(seed=seed, **costs),
    )


def toy_fleet(*engines: EngineSpec) -> FleetSpec:
    return FleetSpec(name="toy", engines=engines or (toy_engine("w0"), toy_engine("w1")))


def request(
    rid: str,
    at_s: float,
    segments: Sequence[tuple[int, int]],
    output: int = 1,
    bound: float | None = None,
) -> TraceRequest:
    return TraceRequest(
        request_id=RequestId(rid),
        arrival_s=at_s,
        prompt_tokens=sum(length for _, length in segments),
        output_tokens=output,
        segment_keys=tuple(key for key, _ in segments),
        segment_lengths=tuple(length for _, length in segments),
    ).with_bound(bound)


TOY_TRACE = [
    request("r0", 0.0, [(100, 40)], output=2, bound=10.0),
    request("r1", 0.0, [(101, 60)]),
    request("r2", 0.02, [(102, 20)], bound=0.05),
    request("r3", 1.0, [(101, 60), (103, 8)]),
]


def by_id(records: Sequence[Graded]) -> dict[str, Graded]:
    return {record.request_id: record for record in records}


def run(policy: RoutingPolicy, fleet: FleetSpec | None = None, **kwargs: Any) -> list[Graded]:
    return list(replay(TOY_TRACE, fleet or toy_fleet(), policy, progress=False, **kwargs).records)


# --------------------------------------------------------------------------- hand-computed


def test_round_robin_ttfts_by_hand() -> None:
    fleet = toy_fleet()
    records = by_id(run(RoundRobin(FleetLedger.for_fleet(fleet)), fleet))
    # w0: r0 prefills alone (0.01 + 0.04); r2, queued at 0.02, runs beside r0's decode
    # (0.01 + 0.02 + 0.002) and both finish at 0.082. w1: r1 alone (0.01 + 0.06); r3
    # finds r1's 15 blocks cached and prefills 8 tokens (0.01 + 0.008).
    expected = {
        "r0": ("w0", 0.05, 0, 2, 0.082),
        "r1": ("w1", 0.07, 0, 1, 0.07),
        "r2": ("w0", 0.062, 0, 1, 0.062),
        "r3": ("w1", 0.018, 60, 1, 0.018),
    }
    for rid, (worker, ttft, cached, output, e2e) in expected.items():
        record = records[rid]
        assert (record.status, record.worker_id, record.admitted) == ("served", worker, True)
        assert record.actual_ttft_s == pytest.approx(ttft)
        assert record.engine_cached_tokens == cached
        assert (record.output_tokens, record.block_size) == (output, BLOCK)
        assert record.e2e_s == pytest.approx(e2e)
        # No prediction and no credited cache: nothing to grade against.
        assert record.predicted_ttft_s is None and record.error_s is None
        assert record.cache_disagreement is None and record.credited_cached_tokens == 0
    assert records["r3"].ts == pytest.approx(EPOCH_BASE_TS + 1.0)


def test_least_outstanding_tokens_ttfts_by_hand() -> None:
    fleet = toy_fleet()
    records = by_id(run(LeastOutstandingTokens(FleetLedger.for_fleet(fleet)), fleet))
    # r0 ties to w0, r1 avoids r0's 40 tokens, r2 prefers w0's 40 to w1's 60; at 1.0 s all
    # is finished and r3 ties to w0, where nothing of it is cached (0.01 + 0.068).
    assert {rid: r.worker_id for rid, r in records.items()} == {
        "r0": "w0",
        "r1": "w1",
        "r2": "w0",
        "r3": "w0",
    }
    assert records["r2"].actual_ttft_s == pytest.approx(0.062)
    assert records["r3"].actual_ttft_s == pytest.approx(0.078)
    assert records["r3"].engine_cached_tokens == 0


def test_speedup_divides_arrival_times() -> None:
    fleet = toy_fleet()
    records = by_id(run(RoundRobin(FleetLedger.for_fleet(fleet)), fleet, speedup=4.0))
    assert records["r3"].ts == pytest.approx(EPOCH_BASE_TS + 0.25)
    # r2 now arrives at 0.005, still during r0's first step: same TTFT plus 0.015 s.
    assert records["r2"].actual_ttft_s == pytest.approx(0.077)


# --------------------------------------------------------------------------- decisions


class Gatekeeper(IgnoresFeedback):
    """Rejects prompts over 50 tokens; sends the rest to the first worker, predicting
    0.05 s and crediting 8 cached tokens, and flags r2 as exploration."""

    name = "gatekeeper"

    def __init__(self, fleet: FleetView, seed: int = 0) -> None:
        self.finished: list[tuple[str, str | None]] = []

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        if request.prompt_tokens > 50:
            return Decision.reject("too long", retry_after_s=2.0)
        worker = fleet.workers_for(request.model)[0].worker_id
        return Decision(
            worker,
            "first",
            predicted_ttft_s=0.05,
            queue_wait_s=0.0,
            prefill_s=0.05,
            cached_tokens=8,
            explore=request.request_id == "r2",
        )

    def on_finished(self, seen: FinishedSeen) -> None:
        self.finished.append((seen.request_id, seen.error))


def test_rejections_predictions_and_cache_disagreement_are_recorded() -> None:
    fleet = toy_fleet()
    records = by_id(run(Gatekeeper(FleetLedger.for_fleet(fleet)), fleet))
    for rid in ("r1", "r3"):
        rejected = records[rid]
        assert (rejected.status, rejected.admitted, rejected.worker_id) == ("rejected", False, None)
        assert rejected.retry_after_s == 2.0 and rejected.actual_ttft_s is None
        assert rejected.block_size is None and rejected.e2e_s is None
    r0, r2 = records["r0"], records["r2"]
    assert r0.actual_ttft_s == pytest.approx(0.05) and r0.error_s == pytest.approx(0.0)
    # r2 no longer shares w0 with r1's prompt but still waits for r0's step.
    assert r2.actual_ttft_s == pytest.approx(0.062)
    assert r2.error_s == pytest.approx(0.05 - 0.062)
    # 8 credited, 0 reported: two blocks apart.
    assert (r0.credited_cached_tokens, r0.engine_cached_tokens, r0.cache_disagreement) == (
        8,
        0,
        True,
    )
    assert (r0.explore, r2.explore) == (False, True)
    assert (r0.predicted_ttft_s, r0.queue_wait_s, r0.prefill_s) == (0.05, 0.0, 0.05)


class SendAll(Gatekeeper):
    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        return Decision(fleet.workers_for(request.model)[0].worker_id, "only")


def test_a_request_no_engine_can_hold_is_an_error() -> None:
    # 12 blocks of 4: r0 needs ceil(41 / 4) = 11, r1 ceil(60 / 4) = 15.
    fleet = toy_fleet(toy_engine("w0", gpu_blocks=12))
    policy = SendAll(FleetLedger.for_fleet(fleet))
    trace = [request("r0", 0.0, [(1, 40)], output=2), request("r1", 0.0, [(2, 60)])]
    records = by_id(replay(trace, fleet, policy, progress=False).records)
    assert records["r0"].status == "served"
    assert (records["r1"].status, records["r1"].worker_id) == ("error", "w0")
    assert records["r1"].actual_ttft_s is None
    (error,) = [e for rid, e in policy.finished if rid == "r1"]
    assert error is not None and "KV blocks" in error


def test_a_choice_outside_the_model_is_refused() -> None:
    class Stray(Gatekeeper):  # names a worker that does not exist
        def decide(self, request: Arrival, fleet: FleetView) -> Decision:
            return Decision(WorkerId("nowhere"), "lost")

    fleet = toy_fleet()
    with pytest.raises(ValueError, match="not a worker"):
        replay(TOY_TRACE, fleet, Stray(FleetLedger.for_fleet(fleet)), progress=False)


# --------------------------------------------------------------------------- feedback


class Recorder(RoundRobin):
    """Round robin that logs every callback, asking for KV events in a given detail."""

    def __init__(self, fleet: FleetView, seed: int = 0, detail: KvEventDetail = "full") -> None:
        super().__init__(fleet, seed)
        self.kv_events = detail
        self.log: list[tuple[Any, ...]] = []

    def on_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent], t_s: float) -> None:
        self.log.append(("kv", worker_id, tuple(events), t_s))

    def on_first_token(self, seen: FirstTokenSeen) -> None:
        self.log.append(("first", *astuple(seen)))

    def on_finished(self, seen: FinishedSeen) -> None:
        self.log.append(("done", *astuple(seen)))


def test_feedback_arrives_at_the_simulated_times() -> None:
    fleet = toy_fleet()
    policy = Recorder(FleetLedger.for_fleet(fleet))
    records = by_id(run(policy, fleet))
    firsts = {entry[1]: entry for entry in policy.log if entry[0] == "first"}
    for rid, record in records.items():
        _, _, worker, ttft, cached, at_s = firsts[rid]
        assert (worker, cached, ttft) == (
            record.worker_id,
            record.engine_cached_tokens,
            record.actual_ttft_s,
        )
        assert at_s == pytest.approx(record.ts - EPOCH_BASE_TS + ttft)
    times = [entry[-1] if entry[0] != "done" else entry[5] for entry in policy.log]
    assert times == sorted(times)
    # w1 stored r1's 15 blocks when it computed them, before r1's first token.
    stored = [
        (entry[3], h)
        for entry in policy.log
        if entry[0] == "kv" and entry[1] == "w1"
        for event in entry[2]
        if isinstance(event, BlockStored)
        for h in event.block_hashes
    ]
    assert len(stored) == 15 + 2  # r1's blocks, then r3's two new full blocks
    assert all(t == pytest.approx(0.07) for t, _ in stored[:15])


def test_the_baselines_get_no_kv_events() -> None:
    fleet = toy_fleet()
    policy = Recorder(FleetLedger.for_fleet(fleet), detail="off")
    with_events = run(Recorder(FleetLedger.for_fleet(fleet)), fleet)
    assert run(policy, fleet) == with_events
    assert not [entry for entry in policy.log if entry[0] == "kv"]


# --------------------------------------------------------------------------- determinism


def noisy_fleet(seed: int = 7) -> FleetSpec:
    noise = {"noise_sigma": 0.3, "stall_probability": 0.05, "stall_s": 0.05}
    return toy_fleet(
        toy_engine(
            "w0", gpu_blocks=60, cpu_blocks=30, seed=seed, cpu_load_s_per_token=1e-5, **noise
        ),
        toy_engine("w1", gpu_blocks=80, seed=seed + 1, decode_s_per_context_token=1e-5, **noise),
    )


def workload(n: int, seed: int, rate_rps: float = 40.0) -> list[TraceRequest]:
    return synthetic_requests(
        n,
        rate_rps=rate_rps,
        prompt=LengthDistribution(median=40, sigma=0.6, max_tokens=120),
        output=LengthDistribution(median=12, sigma=0.8, max_tokens=60),
        sharing=SharingModel(system_prompt_tokens=(16, 32), followup_probability=0.5, seed=seed),
        seed=seed,
    )


def test_same_seeds_same_records() -> None:
    trace = workload(60, seed=3)

    def records(engine_seed: int) -> tuple[Graded, ...]:
        fleet = noisy_fleet(engine_seed)
        policy = LeastOutstandingTokens(FleetLedger.for_fleet(fleet))
        return replay(trace, fleet, policy, progress=False).records

    first = records(7)
    assert first == records(7)
    other = records(8)
    assert [r.actual_ttft_s for r in first] != [r.actual_ttft_s for r in other]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), rate_rps=st.sampled_from([5.0, 40.0, 400.0]))
def test_decode_runs_are_exactly_stepping(seed: int, rate_rps: float) -> None:
    trace = workload(30, seed=seed, rate_rps=rate_rps)
    fleet = noisy_fleet(seed)

    def outcome(step_by_step: bool) -> tuple[tuple[Graded, ...], list[tuple[Any, ...]], int]:
        policy = Recorder(FleetLedger.for_fleet(fleet), seed=seed)
        result = replay(trace, fleet, policy, progress=False, step_by_step=step_by_step)
        return result.records, policy.log, result.engine_steps

    assert outcome(step_by_step=False) == outcome(step_by_step=True)


# --------------------------------------------------------------------------- summary, lake


def test_summary_counts_tails_goodput_and_cache() -> None:
    fleet = toy_fleet()
    records = run(Gatekeeper(FleetLedger.for_fleet(fleet)), fleet)
    stats = summary(records)
    assert (stats["requests"], stats["served"], stats["rejected"], stats["errors"]) == (4, 2, 2, 0)
    assert stats["ttft_p50_s"] == pytest.approx((0.05 + 0.062) / 2)
    # r0 met its 10 s bound; r2 took 0.062 s against 0.05 s.
    assert (stats["goodput"], stats["goodput_fraction"]) == (1, 0.25)
    assert stats["cache_hit_rate"] == 0.0 and stats["per_worker"] == {"w0": 2}
    served = summary(run(RoundRobin(FleetLedger.for_fleet(fleet)), fleet))
    assert served["cache_hit_rate"] == pytest.approx(60 / (40 + 60 + 20 + 68))
    assert served["goodput"] == 3


def test_lake_is_hour_partitioned_and_reads_back_with_duckdb(tmp_path: Path) -> None:
    fleet = toy_fleet()
    trace = [*TOY_TRACE, request("r4", 3700.0, [(104, 12)])]
    records = replay(trace, fleet, RoundRobin(FleetLedger.for_fleet(fleet)), progress=False).records
    write_lake(records, tmp_path)
    write_lake(records[:1], tmp_path)
    assert not list(tmp_path.rglob("*.tmp"))
    pattern = str(tmp_path / "graded" / "*" / "*.parquet")
    with duckdb.connect() as db:
        rows = db.execute(
            "SELECT hour, count(*), count(DISTINCT request_id) FROM "
            f"read_parquet('{pattern}', hive_partitioning = true) GROUP BY hour ORDER BY hour"
        ).fetchall()
        assert rows == [("2025-01-01T00", 5, 4), ("2025-01-01T01", 1, 1)]
        described = db.execute(
            f"DESCRIBE SELECT * FROM read_parquet('{pattern}', hive_partitioning = true)"
        ).fetchall()
        columns = [row[0] for row in described]
        ttft = db.execute(
            f"SELECT actual_ttft_s, worker_id FROM read_parquet('{pattern}') "
            "WHERE request_id = 'r3' LIMIT 1"
        ).fetchone()
    # The files hold the Graded fields; the hour comes from the path.
    assert columns == [*graded_schema(), "hour"]
    one_file = next((tmp_path / "graded").glob("hour=*/*.parquet"))
    assert pl.read_parquet(one_file).columns == list(graded_schema())
    assert ttft is not None and ttft[0] == pytest.approx(0.018) and ttft[1] == "w1"


# --------------------------------------------------------------------------- what-if


def test_capacity_speedup_by_hand() -> None:
    fleet = toy_fleet(toy_engine("w0"))
    trace = [request("a", 0.0, [(1, 100)]), request("b", 10.0, [(1, 100)])]
    # Cold: 0.1 s a request, 10 requests/s of capacity against 2 per 10 s offered.
    assert capacity_speedup(trace, fleet, reuse_prefixes=False) == pytest.approx(50.0)
    # b reuses a's 100 tokens but recomputes its last one: (0.1 + 0.001) / 2 s a request.
    assert capacity_speedup(trace, fleet) == pytest.approx((1 / 0.0505) * 10 / 2)


def test_run_replay_on_the_shipped_trace(tmp_path: Path) -> None:
    result = run_replay(limit=40, capacity_factor=1.0, out_dir=tmp_path, progress=False)
    assert len(result.records) == 40 and result.speedup > 1
    assert {r.status for r in result.records} == {"served"}
    assert list((tmp_path / "graded").glob("hour=*/part-*.parquet"))
