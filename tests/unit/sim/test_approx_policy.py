"""The predictor on engines that say nothing about their cache (``predictor-approx``,
fleet/predictor_policy.py): the same noise-free fleet and trace as test_predictor_policy,
but no KV events and no engine-reported cached tokens reach the predictor. It must still
learn each curve from never-seen prompts on idle workers, and credit the follow-ups from
the prompts it routed — what the simulated engine really reused (which only the replay's
records know) is the check."""

from __future__ import annotations

import pytest

from foretoken.sim.policy import FleetLedger, make_policy
from foretoken.sim.predictor_policy import ApproxPredictorPolicy
from foretoken.sim.replay import replay
from foretoken.wire.records import Graded
from tests.unit.sim.test_predictor_policy import (
    BLOCK,
    FLEET,
    FOLLOW_UP_EVERY,
    FOLLOW_UP_TOKENS,
    LEARN_REQUESTS,
    quiet_stretch,
    trace,
)


@pytest.fixture(scope="module")
def run() -> tuple[ApproxPredictorPolicy, tuple[Graded, ...]]:
    policy = ApproxPredictorPolicy.for_fleet(FLEET, seed=0)
    result = replay(trace(), FLEET, policy, progress=False)
    return policy, result.records


def test_it_learns_without_events_or_cached_token_reports(
    run: tuple[ApproxPredictorPolicy, tuple[Graded, ...]],
) -> None:
    policy, _ = run
    assert policy.counters.kv_batches == 0
    assert all(not r.has_kv_events and not r.reports_cached_tokens
               for r in policy.service.book.profiles.values())  # fmt: skip
    assert policy.counters.cold_samples >= LEARN_REQUESTS // 2
    for spec in FLEET.engines:
        assert not policy.service.fits.curve(spec.id).default


def test_follow_ups_get_approximate_credit_equal_to_what_the_engine_reused(
    run: tuple[ApproxPredictorPolicy, tuple[Graded, ...]],
) -> None:
    policy, records = run
    quiet = quiet_stretch(records)
    follow_ups = quiet[FOLLOW_UP_EVERY - 1 :: FOLLOW_UP_EVERY]
    for r in follow_ups:
        assert r.engine_cached_tokens is not None  # the replay knows; the predictor did not
        assert r.credited_cached_tokens == r.engine_cached_tokens
        assert r.credited_cached_tokens >= r.prompt_tokens - FOLLOW_UP_TOKENS - BLOCK
        grant = policy.service.decisions[r.request_id]
        assert grant.cache_source == "approximate" and grant.approximate_cache
    assert all(r.cache_disagreement is False for r in quiet)
    # the replay's lake rows say where the credit came from
    assert all(r.cache_source == "approximate" and r.approximate_cache for r in records)


def test_the_registry_builds_it_by_name() -> None:
    policy = make_policy("predictor-approx", FleetLedger.for_fleet(FLEET), seed=3)
    assert isinstance(policy, ApproxPredictorPolicy) and policy.kv_events == "off"
