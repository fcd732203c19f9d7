"""The learned CPU-tier load cost converges to the engine's hidden one (issue 15 point 4).

One engine with a GPU pool that holds about one prompt and a large CPU tier: prompts that
come back after others pushed them out of GPU memory are credited from the CPU tier (the
index follows the chain across tiers). Requests arrive one at a time, so each ran alone; the
predictor learns the tier's cost per token from those TTFTs less its own fitted prefill,
starting from the configured prior (2e-6 s per token, 4x below the truth). Both rest on a
curve whose cold samples have their step overheads taken out (10 ms a step here: left in,
the curve's ``a`` came out 1.3x and the tier 0.65x). Only this test reads the truth, to
grade: within ±20%.
"""

from __future__ import annotations

import numpy as np
import pytest

from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import replay
from foretoken.sim.spec import EngineSpec, FleetSpec, KvCapacity, TruthSpec
from foretoken.sim.traces import TraceRequest
from foretoken.wire.records import SchedulerSettings

MODEL = ModelName("tier-model")
TRUE_CPU_S_PER_TOKEN = 8e-6
W = WorkerId("offload")


def fleet() -> FleetSpec:
    return FleetSpec(name="tiers", engines=(EngineSpec(
        id=W, model=MODEL, block_size=16,
        kv=KvCapacity(gpu_blocks=640, cpu_blocks=16_384),  # 10k tokens on GPU, 262k on CPU
        scheduler=SchedulerSettings(max_num_batched_tokens=8192, max_num_seqs=16),
        truth=TruthSpec(prefill_a_s_per_token=4e-5, prefill_b_s_per_token2=1e-11,
                        step_overhead_s=0.01, decode_s_per_seq=1e-4, noise_sigma=0.03,
                        cpu_load_s_per_token=TRUE_CPU_S_PER_TOKEN, seed=5),
    ),))  # fmt: skip


def trace(n: int = 160, prefixes: int = 12, seed: int = 2) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    out = []
    at_s = 0.0
    for i in range(n):
        key = int(rng.integers(prefixes))
        head = 600 + 700 * key  # a document of its own, 0.6k-8.3k tokens
        tail = int(rng.integers(64, 512))  # a new question about it
        out.append(TraceRequest(
            request_id=RequestId(f"t{i:04d}"), arrival_s=at_s, prompt_tokens=head + tail,
            output_tokens=8 if i % 8 else 400, segment_keys=(1000 + key, 900_000 + i),
            segment_lengths=(head, tail),
        ))  # fmt: skip
        # mostly one at a time; every 8th request decodes long, so that the next few run
        # beside a decode and the step fit sees one and two sequences running
        at_s += 2.0 if i % 8 else 0.5
    return out


def test_the_cpu_tier_cost_is_learned_from_requests_credited_there() -> None:
    spec = fleet()
    policy = PredictorPolicy.for_fleet(spec)
    result = replay(trace(), spec, policy, progress=False)
    costs = policy.core.service.predictions.tier_costs
    assert sum(r.status == "served" for r in result.records) == 160
    assert costs.samples(W, "CPU") >= 20, "requests credited from the CPU tier were samples"
    assert costs.cost(W, "CPU") == pytest.approx(TRUE_CPU_S_PER_TOKEN, rel=0.2)
    curve = policy.core.service.fits.curve(W)
    assert not curve.default and curve.a == pytest.approx(4e-5, rel=0.2)
