"""A worker that is never idle learns its prefill curve from its own steps' KV batches
(core/cost/kv_steps.py; issue 15 point 3, "a cold start that does not starve").

Prompts arrive faster than the engine prefills them, so after the first none runs alone
(no cold sample) and prompts queue throughout. The policy learns only from what the
route service sees (KV batches with the engine's stamps, first tokens, completions);
only this test reads the truth, to grade what was learned: ``a`` within ±20% for good
from the first tokens on, where the same run without step samples takes more than ten
first tokens longer (measured: 0 against 160, i.e. never, and 0 against 14).

The samples time one step each, and a step's overhead is taken out at the step cost
learned from decode windows: while that is still the default (15 ms against a true 8)
``a`` reads short by the difference per step's tokens (9 µs against a true 12 µs per
token at 2,048 tokens a step, until the step cost is learned).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.settings import load_settings
from foretoken.sim.policy import FirstTokenSeen
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import replay
from foretoken.sim.spec import EngineSpec, FleetSpec, KvCapacity, TruthSpec
from foretoken.sim.traces import TraceRequest
from foretoken.wire.records import SchedulerSettings

MODEL = ModelName("steps-model")
TOLERANCE = 0.2


def _engine(worker: str, a: float, budget: int, cap: int) -> EngineSpec:
    return EngineSpec(
        id=WorkerId(worker), model=MODEL, block_size=16, kv=KvCapacity(gpu_blocks=60_000),
        scheduler=SchedulerSettings(max_num_batched_tokens=budget, max_num_seqs=64,
                                    long_prefill_token_threshold=cap),
        truth=TruthSpec(prefill_a_s_per_token=a, prefill_b_s_per_token2=3e-11,
                        step_overhead_s=0.008, decode_s_per_seq=2e-4,
                        decode_s_per_context_token=4e-9, noise_sigma=0.05, seed=5),
    )  # fmt: skip


# Two engines on which busy chains alone take long (a cap below the budget: every step
# shares chunks of several prompts, and a chain's ends carry chunks of others).
ENGINES = (_engine("capped", 2.0e-5, 4096, 1024), _engine("slow", 4.0e-5, 8192, 2048))


def _trace(seed: int = 3) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    out, at_s = [], 0.0
    for i in range(160):
        n = int(rng.integers(1_000, 12_000))
        out.append(TraceRequest(
            request_id=RequestId(f"k{i:04d}"), arrival_s=at_s, prompt_tokens=n,
            output_tokens=int(rng.integers(8, 64)), segment_keys=(90_000 + i,),
            segment_lengths=(n,),
        ))  # fmt: skip
        at_s += float(rng.exponential(0.04))
    return out


class _Watched(PredictorPolicy):
    """Records the worker's curve at every first token."""

    def on_first_token(self, seen: FirstTokenSeen) -> None:
        super().on_first_token(seen)
        curve = self.service.fits.curve(seen.worker_id)
        self.seen.append(None if curve.default else curve.a)

    seen: list[float | None]


def _settled_after(spec: EngineSpec, step_samples: bool) -> int:
    """The first tokens before the worker's ``a`` is within ±20% of the truth for good
    (every first token if never)."""
    fleet = FleetSpec(name="kv-steps", engines=(spec,))
    settings = load_settings(env={})
    config = dataclasses.replace(settings.predictor, kv_step_samples=step_samples)
    policy = _Watched.for_fleet(fleet, seed=0, settings=settings, config=config)
    policy.seen = []
    replay(_trace(), fleet, policy, progress=False)
    assert not policy.service.fits.has_cold_fit(spec.id), "a cold sample came: not starving"
    true_a = spec.truth.prefill_a_s_per_token
    good = [a is not None and abs(a / true_a - 1.0) <= TOLERANCE for a in policy.seen]
    bad = [i for i, ok in enumerate(good) if not ok]
    return bad[-1] + 1 if bad else 0


@pytest.mark.parametrize("spec", ENGINES, ids=lambda s: str(s.id))
def test_a_busy_workers_steps_teach_its_prefill_curve(spec: EngineSpec) -> None:
    with_steps, without = _settled_after(spec, True), _settled_after(spec, False)
    assert with_steps <= 10, f"{spec.id}: a within ±20% only after {with_steps} first tokens"
    assert without > with_steps + 10, f"without step samples {without}: the test shows nothing"
