"""The routing-policy contract (fleet/policy.py), run against every registered policy, plus
the baselines' own behaviour and the registry."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import strategies as st

import foretoken.sim.cache_aware
import foretoken.sim.predictor_policy  # noqa: F401  (registers "predictor" for the contract)
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
    make_policy,
    policy_names,
    register_policy,
    unregister_policy,
)
from foretoken.sim.spec import EngineSpec, FleetSpec, KvCapacity, TruthSpec
from foretoken.wire.records import SchedulerSettings

MODEL_A, MODEL_B, UNSERVED = ModelName("model-a"), ModelName("model-b"), ModelName("nobody")


def engine(worker: str, model: str, *, a: float = 1e-4, block_size: int = 16) -> EngineSpec:
    return EngineSpec(
        id=WorkerId(worker),
        model=ModelName(model),
        block_size=block_size,
        kv=KvCapacity(gpu_blocks=4096),
        scheduler=SchedulerSettings(max_num_batched_tokens=512, max_num_seqs=16),
        truth=TruthSpec(prefill_a_s_per_token=a, prefill_b_s_per_token2=1e-9),
    )


def two_model_fleet(a: float = 1e-4) -> FleetSpec:
    return FleetSpec(
        name="two-models",
        engines=(
            engine("a-0", MODEL_A, a=a),
            engine("a-1", MODEL_A, a=2 * a, block_size=32),
            engine("a-2", MODEL_A, a=3 * a),
            engine("b-0", MODEL_B, a=a),
        ),
    )


def route(index: int, model: str, prompt_tokens: int, at_s: float) -> Arrival:
    return Arrival(
        request_id=RequestId(f"r{index}"),
        model=ModelName(model),
        arrival_s=at_s,
        prompt_tokens=prompt_tokens,
        token_ids=list(range(index, index + prompt_tokens)),
        max_tokens=4,
        max_queue_wait_s=None if index % 3 else 10.0,
    )


@dataclass(frozen=True)
class Step:
    """One scripted event: a request arrives, or the oldest outstanding one finishes."""

    model: str
    prompt_tokens: int
    finish_oldest: bool


steps = st.lists(
    st.builds(
        Step,
        model=st.sampled_from([MODEL_A, MODEL_A, MODEL_B, UNSERVED]),
        prompt_tokens=st.integers(1, 4000),
        finish_oldest=st.booleans(),
    ),
    min_size=1,
    max_size=40,
)


def drive(policy: RoutingPolicy, ledger: FleetLedger, script: Sequence[Step]) -> Iterator[Decision]:
    """Play a script the way a driver would: decide, record what was sent, then feed back
    a first token and a completion for the oldest outstanding request when told to."""
    outstanding: list[tuple[RequestId, WorkerId]] = []
    for index, step in enumerate(script):
        at_s = 0.1 * index
        request = route(index, step.model, step.prompt_tokens, at_s)
        decision = policy.decide(request, ledger)
        yield decision
        if decision.worker_id is not None:
            ledger.record_sent(request.request_id, decision.worker_id, request.prompt_tokens)
            outstanding.append((request.request_id, decision.worker_id))
        if step.finish_oldest and outstanding:
            rid, worker = outstanding.pop(0)
            ledger.record_first_token(rid)
            policy.on_kv_events(worker, (), at_s)
            policy.on_first_token(FirstTokenSeen(rid, worker, 0.05, 0, at_s))
            ledger.record_finished(rid)
            policy.on_finished(FinishedSeen(rid, worker, 4, 0.1, at_s))


# Every registered policy runs the contract; a policy registered by another module (the
# predictor's) joins once that module is imported above.
each_policy = pytest.mark.parametrize("policy_name", policy_names())


# --------------------------------------------------------------------------- baselines


def test_round_robin_takes_each_models_workers_in_turn() -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    policy = RoundRobin(ledger, seed=1)
    chosen = [policy.decide(route(i, MODEL_A, 10, 0.0), ledger).worker_id for i in range(6)]
    assert chosen == ["a-1", "a-2", "a-0", "a-1", "a-2", "a-0"]
    assert policy.decide(route(9, MODEL_B, 10, 0.0), ledger).worker_id == "b-0"


def test_least_outstanding_tokens_follows_what_was_sent_and_finished() -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    policy = LeastOutstandingTokens(ledger)
    ledger.record_sent(RequestId("x"), WorkerId("a-0"), 5000)
    ledger.record_sent(RequestId("y"), WorkerId("a-1"), 100)
    assert policy.decide(route(0, MODEL_A, 10, 0.0), ledger).worker_id == "a-2"
    ledger.record_sent(RequestId("z"), WorkerId("a-2"), 200)
    assert policy.decide(route(1, MODEL_A, 10, 0.0), ledger).worker_id == "a-1"
    ledger.record_finished(RequestId("x"))
    assert policy.decide(route(2, MODEL_A, 10, 0.0), ledger).worker_id == "a-0"


def test_the_ledger_counts_awaiting_and_outstanding_work() -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    worker = WorkerId("a-0")
    ledger.record_sent(RequestId("x"), worker, 300)
    ledger.record_sent(RequestId("y"), worker, 200)
    ledger.record_first_token(RequestId("x"))
    load = ledger.load(worker)
    assert (load.outstanding_requests, load.outstanding_prompt_tokens) == (2, 500)
    assert (load.awaiting_first_token, load.awaiting_prompt_tokens) == (1, 200)
    ledger.record_finished(RequestId("y"))  # finished without a first token seen: errored
    ledger.record_finished(RequestId("x"))
    assert ledger.load(worker) == ledger.load(WorkerId("b-0"))


def test_the_view_carries_reported_settings_only() -> None:
    spec = two_model_fleet().engine("a-1")
    info = spec.profile()
    assert (info.block_size, info.scheduler, info.config_hash) == (
        32,
        spec.scheduler,
        spec.config_hash,
    )
    view = FleetView([info])
    assert view.workers_for(MODEL_A) == (info,) and view.workers_for(MODEL_B) == ()


# --------------------------------------------------------------------------- registry, values


class _AlwaysFirst(IgnoresFeedback):
    name = "always-first"

    def __init__(self, fleet: FleetView, seed: int = 0) -> None:
        pass

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        workers = fleet.workers_for(request.model)
        if not workers:
            return Decision.reject("no worker")
        return Decision(workers[0].worker_id, "first")


def test_a_registered_policy_is_made_by_name() -> None:
    register_policy(_AlwaysFirst.name, _AlwaysFirst)
    try:
        assert _AlwaysFirst.name in policy_names()
        ledger = FleetLedger.for_fleet(two_model_fleet())
        policy = make_policy(_AlwaysFirst.name, ledger)
        assert policy.decide(route(0, MODEL_A, 10, 0.0), ledger).worker_id == "a-0"
        with pytest.raises(ValueError, match="already registered"):
            register_policy(_AlwaysFirst.name, _AlwaysFirst)
    finally:
        unregister_policy(_AlwaysFirst.name)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy(_AlwaysFirst.name, FleetLedger.for_fleet(two_model_fleet()))


def test_a_decision_checks_its_numbers() -> None:
    with pytest.raises(ValueError, match="reason"):
        Decision(WorkerId("a-0"), "")
    with pytest.raises(ValueError, match="predicted_ttft_s"):
        Decision(WorkerId("a-0"), "x", predicted_ttft_s=-1.0)
    with pytest.raises(ValueError, match="retry_after_s"):
        Decision.reject("busy", retry_after_s=math.inf)
    assert not Decision.reject("busy", retry_after_s=2.0).admitted
