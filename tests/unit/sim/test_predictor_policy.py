"""The live predictor as a replay policy (fleet/predictor_policy.py): it learns each
engine's curve from the cold requests the pipeline would see, and then predicts TTFT.

The fleet is noise-free: two engines of one model with different true curves, a small
step overhead and cheap decode. The trace has a learning stretch (one request every 1.5 s,
unique prompts of 1k-16k tokens, so each is cold and alone: prefill samples), a busy
stretch (one every 50 ms, so requests overlap: the step-cost fit needs a spread of running
requests) and a quiet stretch (one every 0.5 s; every third extends an earlier prompt, so
the index must credit its cache). Only the test reads the engines' truth, to check what
the policy learned.
"""

from __future__ import annotations

import numpy as np
import pytest

from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.sim.policy import FleetLedger, make_policy
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import replay
from foretoken.sim.spec import EngineSpec, FleetSpec, KvCapacity, TruthSpec
from foretoken.sim.traces import TraceRequest
from foretoken.wire.records import Graded, SchedulerSettings

MODEL = ModelName("quiet-model")
BLOCK = 16
LEARN_REQUESTS = 48
LEARN_GAP_S = 1.5
BUSY_REQUESTS = 40
BUSY_GAP_S = 0.05
QUIET_REQUESTS = 30
QUIET_GAP_S = 0.5
FOLLOW_UP_EVERY = 3
FOLLOW_UP_TOKENS = 300
# Fitted cost within this fraction of the true C(N) over the prompts the fleet saw. The
# fit's a also absorbs the per-step overhead (about overhead / budget per token).
CURVE_TOLERANCE = 0.05
# A quiet-stretch prediction is within this many seconds plus this fraction of the actual.
TTFT_ABS_TOLERANCE_S = 0.005
TTFT_REL_TOLERANCE = 0.05


def engine(worker: str, a: float, b: float) -> EngineSpec:
    return EngineSpec(
        id=WorkerId(worker),
        model=MODEL,
        block_size=BLOCK,
        kv=KvCapacity(gpu_blocks=8192),
        scheduler=SchedulerSettings(max_num_batched_tokens=4096, max_num_seqs=16),
        truth=TruthSpec(
            prefill_a_s_per_token=a,
            prefill_b_s_per_token2=b,
            step_overhead_s=5e-4,
            decode_s_per_seq=1e-4,
        ),
    )


FLEET = FleetSpec(
    name="quiet",
    engines=(engine("fast", 2.0e-5, 1.0e-9), engine("slow", 4.0e-5, 3.0e-9)),
)


def request(index: int, at_s: float, segments: list[tuple[int, int]]) -> TraceRequest:
    return TraceRequest(
        request_id=RequestId(f"q{index:03d}"),
        arrival_s=at_s,
        prompt_tokens=sum(length for _, length in segments),
        output_tokens=4,
        segment_keys=tuple(key for key, _ in segments),
        segment_lengths=tuple(length for _, length in segments),
    )


def fresh(index: int, at_s: float, tokens: int) -> TraceRequest:
    return request(index, at_s, [(10_000 + index, tokens)])


def trace(seed: int = 7) -> list[TraceRequest]:
    """Learning, busy and quiet stretches (module doc); a quiet follow-up extends the
    prompt of the request two before it, which has finished by then."""
    rng = np.random.default_rng(seed)

    def sizes(n: int, low: int, high: int) -> list[int]:
        return [int(x) for x in np.exp(rng.uniform(np.log(low), np.log(high), n))]

    out = [fresh(i, LEARN_GAP_S * i, n) for i, n in enumerate(sizes(LEARN_REQUESTS, 1000, 16000))]
    at_s = LEARN_GAP_S * LEARN_REQUESTS
    for n in sizes(BUSY_REQUESTS, 1000, 8000):
        out.append(fresh(len(out), at_s, n))
        at_s += BUSY_GAP_S
    at_s += LEARN_GAP_S
    for j, n in enumerate(sizes(QUIET_REQUESTS, 1000, 5000)):
        segments = [(10_000 + len(out), n)]
        if j % FOLLOW_UP_EVERY == FOLLOW_UP_EVERY - 1:
            earlier = out[-2]
            kept = earlier.prompt_tokens // BLOCK * BLOCK
            segments = [(earlier.segment_keys[0], kept), (20_000 + len(out), FOLLOW_UP_TOKENS)]
        out.append(request(len(out), at_s, segments))
        at_s += QUIET_GAP_S
    return out


def quiet_stretch(records: tuple[Graded, ...]) -> tuple[Graded, ...]:
    return records[LEARN_REQUESTS + BUSY_REQUESTS :]


@pytest.fixture(scope="module")
def run() -> tuple[PredictorPolicy, tuple[Graded, ...]]:
    policy = PredictorPolicy.for_fleet(FLEET, seed=0)
    result = replay(trace(), FLEET, policy, progress=False)
    return policy, result.records


def test_the_fits_approach_each_engines_true_curve(
    run: tuple[PredictorPolicy, tuple[Graded, ...]],
) -> None:
    policy, records = run
    learned = records[:LEARN_REQUESTS]
    assert policy.counters.cold_samples >= LEARN_REQUESTS // 2
    sizes = np.linspace(
        min(r.prompt_tokens for r in learned), max(r.prompt_tokens for r in learned), 16
    )
    for spec in FLEET.engines:
        curve = policy.service.fits.curve(spec.id)
        assert not curve.default, f"{spec.id} never left the default curve"
        truth = np.array([spec.truth.prefill_s(int(n)) for n in sizes])
        fitted = np.array([curve.cost_s(float(n)) for n in sizes])
        worst = float(np.max(np.abs(fitted / truth - 1.0)))
        assert worst <= CURVE_TOLERANCE, f"{spec.id}: fitted curve off by {worst:.1%}"


def test_quiet_stretch_predictions_are_close_to_the_actual_ttft(
    run: tuple[PredictorPolicy, tuple[Graded, ...]],
) -> None:
    _, records = run
    quiet = quiet_stretch(records)
    assert all(r.status == "served" and r.fit_default is False for r in quiet)
    for r in quiet:
        assert r.predicted_ttft_s is not None and r.actual_ttft_s is not None
        allowed = TTFT_ABS_TOLERANCE_S + TTFT_REL_TOLERANCE * r.actual_ttft_s
        assert abs(r.predicted_ttft_s - r.actual_ttft_s) <= allowed, r


def test_follow_ups_are_credited_what_the_engine_had_cached(
    run: tuple[PredictorPolicy, tuple[Graded, ...]],
) -> None:
    _, records = run
    quiet = quiet_stretch(records)
    assert all(r.cache_disagreement is False for r in quiet)
    follow_ups = quiet[FOLLOW_UP_EVERY - 1 :: FOLLOW_UP_EVERY]
    for r in follow_ups:  # its prefix is cached where the earlier request ran
        assert r.credited_cached_tokens == r.engine_cached_tokens
        assert r.credited_cached_tokens >= r.prompt_tokens - FOLLOW_UP_TOKENS - BLOCK


def test_the_records_carry_the_prediction_that_grading_needs(
    run: tuple[PredictorPolicy, tuple[Graded, ...]],
) -> None:
    _, records = run
    for r in records:
        assert r.predicted_ttft_s is not None and r.queue_wait_s is not None
        assert r.prefill_s is not None and r.fit_samples is not None
        assert r.error_s == pytest.approx(r.predicted_ttft_s - (r.actual_ttft_s or 0.0))
        assert r.predicted_ttft_s == pytest.approx(r.queue_wait_s + r.prefill_s)
        assert r.cache_source == "events" and not r.approximate_cache


def test_registrations_carry_reported_fields_only() -> None:
    spec = FLEET.engines[1]
    registration = spec.profile()
    assert registration.gpu_blocks == spec.kv.gpu_blocks
    assert registration.config_hash == spec.config_hash
    assert registration.scheduler == spec.scheduler and registration.block_size == BLOCK
    # The same reported fields with another truth register identically.
    other = EngineSpec(
        id=spec.id,
        model=spec.model,
        block_size=spec.block_size,
        kv=spec.kv,
        scheduler=spec.scheduler,
        truth=TruthSpec(prefill_a_s_per_token=1.0, prefill_b_s_per_token2=1.0),
    )
    assert other.profile() == registration


def test_the_registry_builds_it_by_name() -> None:
    ledger = FleetLedger.for_fleet(FLEET)
    policy = make_policy("predictor", ledger, seed=3)
    assert isinstance(policy, PredictorPolicy) and policy.kv_events == "full"
    assert set(policy.service.book.profiles) == {spec.id for spec in FLEET.engines}
