"""The routing-policy contract (house rule 5): every registered policy — the baselines,
the predictor, the predictor on approximate caches — routes within the request's model or
rejects with a reason, decides the same given the same seed, never reads a simulated
engine's hidden truth, leaves the fleet view unchanged and makes valid grants."""

from __future__ import annotations

import math

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

import foretoken.sim.predictor_policy  # noqa: F401  (registers "predictor" for the contract)
from foretoken.core.types import RequestId, WorkerId
from foretoken.sim.policy import (
    Decision,
    FleetLedger,
    RoutingPolicy,
    make_policy,
)
from foretoken.sim.spec import FleetSpec
from foretoken.wire.records import Grant
from tests.unit.sim.test_policy import (
    MODEL_A,
    MODEL_B,
    UNSERVED,
    Step,
    drive,
    each_policy,
    route,
    steps,
    two_model_fleet,
)

# --------------------------------------------------------------------------- the contract


@each_policy
@settings(max_examples=40, deadline=None)
@given(script=steps, seed=st.integers(0, 5))
def test_a_decision_names_a_worker_of_the_model_or_rejects_with_a_reason(
    policy_name: str, script: list[Step], seed: int
) -> None:
    fleet = two_model_fleet()
    ledger = FleetLedger.for_fleet(fleet)
    policy = make_policy(policy_name, ledger, seed=seed)
    assert isinstance(policy, RoutingPolicy) and policy.name
    for step, decision in zip(script, drive(policy, ledger, script), strict=True):
        assert decision.reason
        if decision.worker_id is None:
            assert decision.retry_after_s is None or decision.retry_after_s >= 0
            continue
        assert fleet.engine(decision.worker_id).model == step.model
        for candidate in decision.candidates:
            assert fleet.engine(candidate.worker_id).model == step.model
        if decision.predicted_ttft_s is not None:
            assert math.isfinite(decision.predicted_ttft_s) and decision.predicted_ttft_s >= 0


@each_policy
def test_a_model_nobody_serves_is_rejected_not_raised(policy_name: str) -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    decision = make_policy(policy_name, ledger).decide(route(0, UNSERVED, 100, 0.0), ledger)
    assert decision.worker_id is None and not decision.admitted and decision.reason


@each_policy
@settings(max_examples=20, deadline=None)
@given(script=steps, seed=st.integers(0, 5))
def test_same_seed_same_decisions(policy_name: str, script: list[Step], seed: int) -> None:
    def decisions() -> list[Decision]:
        ledger = FleetLedger.for_fleet(two_model_fleet())
        return list(drive(make_policy(policy_name, ledger, seed=seed), ledger, script))

    assert decisions() == decisions()


@each_policy
@settings(max_examples=20, deadline=None)
@given(script=steps)
def test_decisions_do_not_depend_on_the_hidden_truth(policy_name: str, script: list[Step]) -> None:
    def decisions(fleet: FleetSpec) -> list[Decision]:
        ledger = FleetLedger.for_fleet(fleet)
        return list(drive(make_policy(policy_name, ledger), ledger, script))

    assert decisions(two_model_fleet(a=1e-4)) == decisions(two_model_fleet(a=5e-3))


@each_policy
def test_deciding_leaves_the_view_unchanged(policy_name: str) -> None:
    fleet = two_model_fleet()
    ledger = FleetLedger.for_fleet(fleet)
    ledger.record_sent(RequestId("old"), WorkerId("a-1"), 700)
    policy = make_policy(policy_name, ledger)
    before = {spec.id: ledger.load(spec.id) for spec in fleet.engines}
    for index in range(5):
        policy.decide(route(index, MODEL_A, 300, 0.0), ledger)
    assert {spec.id: ledger.load(spec.id) for spec in fleet.engines} == before


@each_policy
def test_every_decision_makes_a_valid_grant(policy_name: str) -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    policy = make_policy(policy_name, ledger)
    for index, model in enumerate((MODEL_A, MODEL_B, UNSERVED)):
        request = route(index, model, 64, 1.0)
        grant = policy.decide(request, ledger).grant(request, ts=1.0)
        decoded = msgspec.json.decode(msgspec.json.encode(grant), type=Grant)
        assert decoded.admitted == (decoded.worker_id is not None)
        assert decoded.request_id == request.request_id and decoded.model == model
