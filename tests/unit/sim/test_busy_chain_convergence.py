"""Busy chains learn the engine's hidden prefill cost on a chunked engine whose prompts
share steps (issue 15 points 2 and 5).

The ``demo`` fleet's fast engines cap a prompt's chunk at 1,024 tokens of a 4,096-token
step budget, so the long prompts of a Mooncake burst (requests that arrive together) share
every step, and a prompt sent to an idle engine is overtaken by shorter ones sent after it.
A chain that ended at its first step read their chunks as its own: ``a`` came out 1.6-1.7×
the truth on both fast engines (the live demo: 1.6-2.3×). A settled worker's clean chain now
runs from the idle engine's send until nothing sent waits for a first token. The policy
learns only from what a router sees; only this test reads the truth, to grade it.
"""

from __future__ import annotations

import dataclasses

import pytest

from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import replay
from foretoken.sim.spec import load_fleet
from foretoken.sim.traces import load_mooncake

TOLERANCE = 0.15
SPEEDUP, TRACE_S, MAX_OUTPUT = 0.5, 40.0, 16


def test_every_demo_worker_learns_its_prefill_cost_within_tolerance() -> None:
    requests = [
        dataclasses.replace(r, output_tokens=min(r.output_tokens, MAX_OUTPUT))
        for r in load_mooncake(speedup=SPEEDUP) if r.arrival_s * SPEEDUP < TRACE_S
    ]  # fmt: skip
    fleet = load_fleet("demo")
    policy = PredictorPolicy.for_fleet(fleet)
    replay(requests, fleet, policy, speedup=1.0, progress=False)
    fits = policy.core.service.fits
    for spec in fleet.engines:
        curve = fits.curve(spec.id)
        assert not curve.default, spec.id
        true_a = spec.truth.prefill_a_s_per_token
        assert curve.a == pytest.approx(true_a, rel=TOLERANCE), spec.id
