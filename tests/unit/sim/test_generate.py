"""Generated workloads and fleets (issue 15's matrix): seeded, with the properties their
names promise, and fleets that pass the fleet-file validation, schedule included."""

from __future__ import annotations

import numpy as np
import pytest

from foretoken.sim.generate import (
    MIX_LONG_TOKENS,
    SHARED_SYSTEM_TOKENS,
    WORKLOADS,
    fleet_tokens,
    random_fleet,
    random_fleet_mapping,
    workload_scale,
)
from foretoken.sim.spec import load_fleet


def _facts(rows):  # type: ignore[no-untyped-def]
    return [(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.segment_keys,
             r.segment_lengths, r.token_seed) for r in rows]  # fmt: skip


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_workload_is_a_function_of_its_seed(name: str) -> None:
    make = WORKLOADS[name]
    assert _facts(make(300, 3, 1.0)) == _facts(make(300, 3, 1.0))
    assert _facts(make(300, 3, 1.0)) != _facts(make(300, 4, 1.0))
    first = make(300, 3, 1.0)[5]
    assert np.array_equal(first.token_ids, make(300, 3, 1.0)[5].token_ids)


def _gaps(rows):  # type: ignore[no-untyped-def]
    arrivals = np.array([r.arrival_s for r in rows])
    return np.diff(arrivals)


def test_poisson_long_has_long_unshared_prompts_and_poisson_arrivals() -> None:
    rows = WORKLOADS["poisson-long"](4000, 1, 1.0)
    prompts = np.array([r.prompt_tokens for r in rows])
    assert 13_500 <= prompts.mean() <= 16_500
    assert all(len(r.segment_keys) == 1 for r in rows)
    assert len({r.segment_keys[0] for r in rows}) == len(rows)  # nothing shared
    gaps = _gaps(rows)
    assert 0.9 <= gaps.mean() <= 1.1 and 0.9 <= gaps.std() / gaps.mean() <= 1.1


def test_bursty_arrivals_come_in_bursts() -> None:
    gaps = _gaps(WORKLOADS["bursty"](4000, 1, 1.0))
    assert gaps.std() / gaps.mean() > 2.0  # Poisson would be 1


def test_shared_system_sessions_all_start_with_one_long_system_prompt() -> None:
    rows = WORKLOADS["shared-system"](1000, 2, 1.0)
    assert len({(r.segment_keys[0], r.segment_lengths[0]) for r in rows}) == 1
    assert rows[0].segment_lengths[0] == SHARED_SYSTEM_TOKENS
    follow_ups = sum(len(r.segment_keys) > 2 for r in rows)
    assert 0.2 * len(rows) <= follow_ups <= 0.6 * len(rows)
    a, b = rows[0].token_ids, rows[1].token_ids
    assert np.array_equal(a[:SHARED_SYSTEM_TOKENS], b[:SHARED_SYSTEM_TOKENS])


def test_the_mix_is_mostly_1k_with_a_few_200k_prompts_never_scaled() -> None:
    rows = WORKLOADS["mix-1k-200k"](3000, 0, 0.1)
    prompts = np.array([r.prompt_tokens for r in rows])
    long = prompts > 100_000
    assert 0.015 <= long.mean() <= 0.045
    assert abs(np.median(prompts[long]) - MIX_LONG_TOKENS) < 0.05 * MIX_LONG_TOKENS
    assert 800 <= np.median(prompts[~long]) <= 1200


def test_a_scale_shrinks_the_prompts_of_a_small_fleets_workload() -> None:
    small = load_fleet("small")
    assert workload_scale(load_fleet("hetero")) == 1.0
    scale = workload_scale(small)
    assert scale < 1.0
    rows = WORKLOADS["poisson-long"](2000, 1, scale)
    mean = np.mean([r.prompt_tokens for r in rows])
    assert mean < 0.25 * fleet_tokens(small) * 2 and mean > 0.5 * 15_000 * scale


def test_random_fleets_are_seeded_varied_and_valid() -> None:
    assert random_fleet_mapping(3) == random_fleet_mapping(3)
    one, two = random_fleet(1), random_fleet(2)
    costs = {
        (e.truth.prefill_a_s_per_token, e.scheduler.max_num_batched_tokens) for e in one.engines
    }
    assert len(costs) > 1  # engines differ within a fleet
    assert [e.truth for e in one.engines] != [e.truth for e in two.engines]
    for fleet in (one, two):
        assert len(fleet.schedule) == 1
        change = fleet.schedule[0]
        before = fleet.engine(change.engine)
        after = change.apply(before)
        assert after.engine_version != before.engine_version
        assert after.config_hash != before.config_hash  # the predictor starts a fresh fit
        assert after.truth.prefill_a_s_per_token != before.truth.prefill_a_s_per_token
        assert fleet_tokens(fleet) >= 222_000  # the 200k prompts fit


def test_a_random_fleets_change_can_be_placed_in_time() -> None:
    assert random_fleet(1, change_at_s=42.0).schedule[0].at_s == 42.0
