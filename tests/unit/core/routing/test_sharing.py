"""Prompts sent after a request that prefill beside it (foretoken.core.routing.sharing)."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from foretoken.core.routing.sharing import (
    KEEP,
    MAX_SHARE,
    MIN_SENDS,
    RecentSends,
    median_share,
)
from foretoken.core.types import SchedulerSettings, WorkerId

W = WorkerId("w")
CAPPED = SchedulerSettings(max_num_batched_tokens=4096, long_prefill_token_threshold=1024)
A = 5e-5  # s per token


def _sends(rate_per_s: float, sizes: list[int], until_s: float = 100.0) -> RecentSends:
    recent = RecentSends()
    for i, size in enumerate(sizes):
        recent.sent(W, until_s - (len(sizes) - 1 - i) / rate_per_s, size)
    return recent


def test_the_delay_is_the_fixed_point_of_the_later_prompts_share() -> None:
    """20 sends of 4,000 uncached tokens at 0.5 a second: ρ = a·λ·min(u, L/2) = 0.1 for a
    100k-token prompt, so its 6 s of own prefill grow by 6·0.1/0.9."""
    recent = _sends(0.5, [4000] * 20)
    # 19 intervals of 2 s: λ = 20 / 38 s (the span starts at the oldest send)
    rho = A * (20 / 38) * 4000
    got = recent.delay_s(W, 100.0, 60.0, CAPPED, A, 100_000, 6.0)
    assert got == pytest.approx(6.0 * rho / (1 - rho))
    # a prompt shorter than twice the later ones shares only half of itself with each
    small = recent.delay_s(W, 100.0, 60.0, CAPPED, A, 2000, 0.1)
    rho_small = A * (20 / 38) * 1000
    assert small == pytest.approx(min(0.1 * rho_small / (1 - rho_small), A * 2000 * 3))


def test_the_typical_later_prompt_counts_not_a_rare_giant() -> None:
    """The median share: one 100k-token send among small ones does not set the delay."""
    typical = _sends(1.0, [2000] * 19 + [2000])
    with_giant = _sends(1.0, [2000] * 19 + [100_000])
    args = (W, 100.0, 60.0, CAPPED, A, 200_000, 12.0)
    assert with_giant.delay_s(*args) == pytest.approx(typical.delay_s(*args))


def test_no_delay_without_shared_steps_enough_sends_or_recent_ones() -> None:
    recent = _sends(1.0, [4000] * 20)
    args = (A, 50_000, 3.0)
    assert recent.delay_s(W, 100.0, 60.0, CAPPED, *args) > 0
    uncapped = SchedulerSettings(max_num_batched_tokens=4096)  # prompts go one after another
    assert recent.delay_s(W, 100.0, 60.0, uncapped, *args) == 0.0
    serial = SchedulerSettings(max_num_batched_tokens=4096, long_prefill_token_threshold=1024,
                               chunked_prefill=False)  # fmt: skip
    assert recent.delay_s(W, 100.0, 60.0, serial, *args) == 0.0
    assert _sends(1.0, [4000] * (MIN_SENDS - 1)).delay_s(W, 100.0, 60.0, CAPPED, *args) == 0.0
    assert recent.delay_s(W, 500.0, 60.0, CAPPED, *args) == 0.0  # all older than the window
    assert recent.delay_s(WorkerId("other"), 100.0, 60.0, CAPPED, *args) == 0.0
    recent.forget_worker(W)
    assert recent.delay_s(W, 100.0, 60.0, CAPPED, *args) == 0.0


def test_the_delay_is_bounded_by_the_share_and_the_other_chunk_slots() -> None:
    """A flood of later prompts: ρ is capped at MAX_SHARE (at most 1x the own prefill),
    and never more than the three other 1,024-token slots of each of its steps hold."""
    flood = _sends(100.0, [50_000] * KEEP)
    own_s = 10.0
    got = flood.delay_s(W, 100.0, 60.0, CAPPED, A, 100_000, own_s)
    assert got == pytest.approx(min(own_s * MAX_SHARE / (1 - MAX_SHARE), A * 100_000 * 3))
    two_slots = SchedulerSettings(max_num_batched_tokens=2048, long_prefill_token_threshold=1024)
    assert flood.delay_s(W, 100.0, 60.0, two_slots, A, 100_000, 100.0) == pytest.approx(
        A * 100_000 * 1
    )


@pytest.mark.parametrize("window_s", [60.0, 0.0])
def test_a_route_service_puts_the_later_share_into_the_prefill(window_s: float) -> None:
    """Wired end to end: after a stream of sends to a chunk-capped worker, a candidate's
    prefill is its own curve's plus the later prompts' share (none with the window 0)."""
    import numpy as np

    from foretoken.core.index.prefix import PrefixIndex
    from foretoken.core.routing.config import PredictorConfig
    from foretoken.core.routing.service import RouteService
    from foretoken.wire.records import WorkerEndpoints, WorkerRegistration
    from foretoken.wire.route_rpc import RouteRequest

    # no first token ever comes here: the overdue scale (cost.overdue) would price the cold
    # worker slower; this test is about the sharing term alone
    config = PredictorConfig(explore_fraction=0.0, later_sharing_window_s=window_s,
                             overdue_scale=False)  # fmt: skip
    service = RouteService(PrefixIndex(), config=config)
    reg = WorkerRegistration(
        worker_id="w0", model="m", engine="vllm", engine_version="x", block_size=16,
        scheduler=CAPPED, endpoints=WorkerEndpoints(http_url="http://w0"), config_hash="c",
        ts=0.0, gpu_blocks=100_000,
    )  # fmt: skip
    service.index.register_worker(reg.worker_id, reg.model, reg.block_size)
    service.on_registration(reg)
    rng = np.random.default_rng(0)
    for i in range(20):  # a 4,000-token prompt every 2 s
        tokens = tuple(rng.integers(1000, 90_000, 4000).tolist())
        service.route(RouteRequest(request_id=f"r{i}", model="m", token_ids=tokens).query(),
                      2.0 * i, 2.0 * i)  # fmt: skip
    prompt = rng.integers(1000, 90_000, 30_000).tolist()
    (candidate,) = service.predictions.candidates("m", prompt, 40.0, None)
    own = service.fits.curve("w0").own_prefill_s(30_000, 0)
    assert candidate.prediction.prefill_s == pytest.approx(own + candidate.later_s)
    assert (candidate.later_s > 0) == (window_s > 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 200_000), min_size=1, max_size=KEEP), st.integers(1, 200_000),
       st.none() | st.integers(1, 400_000))  # fmt: skip
def test_the_median_share_is_numpys(sizes: list[int], uncached: int, pool: int | None) -> None:
    arr = np.array(sizes, dtype=np.float64)
    shares = np.minimum(arr, uncached / 2)
    if pool:
        shares[arr + uncached > pool] = 0.0
    got = median_share(sorted(sizes), uncached, pool)
    assert got == pytest.approx(float(np.median(shares)), rel=1e-12, abs=1e-9)


def test_a_late_send_takes_its_place_in_time_and_only_the_last_are_kept() -> None:
    """A grant heard late (another replica's, through Kafka) is filed by its send time, so
    the window and the rate stay right; no more than KEEP sends are kept."""
    in_order, shuffled = RecentSends(), RecentSends()
    times = [float(i) for i in range(KEEP + 10)]
    for t in times:
        in_order.sent(W, t, 1000 + int(t))
    late = [*times[: KEEP + 8], times[-1], times[-2]]  # the last two arrive swapped
    for t in late:
        shuffled.sent(W, t, 1000 + int(t))
    args = (W, times[-1], 30.0, CAPPED, A, 50_000, 3.0)
    assert shuffled.delay_s(*args) == in_order.delay_s(*args) > 0
