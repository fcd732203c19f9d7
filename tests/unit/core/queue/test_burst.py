"""The prefill work of a burst (foretoken.core.queue.burst): hand-computed schedules, the
fixed point that recovers ``a`` from a first token's time, and the learner's use of it on a
fresh worker whose first first token is not the first prompt's."""

from __future__ import annotations

import pytest

from foretoken.core.cost.fit import REFERENCE_B_S_PER_TOKEN2
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.queue.burst import Sent, burst_sample, burst_work
from foretoken.core.queue.scheduler import CurveStepCost
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.wire.records import Outcome, SchedulerSettings, WorkerEndpoints, WorkerRegistration
from foretoken.wire.route_rpc import RouteRequest

BUDGET_100 = SchedulerSettings(max_num_batched_tokens=100, max_num_seqs=8)


def _cost(a: float, b: float = 0.0, overhead: float = 0.01, per_seq: float = 0.0) -> CurveStepCost:
    return CurveStepCost(lambda n: n * (a + b * n), overhead, per_seq, (a, b))


def test_two_prompts_sharing_a_budget_are_the_work_before_the_first_token() -> None:
    # step 1: A takes the whole budget (100 of 150); step 2: A's last 50 and B's 50
    sent = [Sent(0.0, 150, 0, 10), Sent(0.0, 50, 0, 10)]
    work = burst_work(BUDGET_100, None, sent, 1, _cost(1e-3))
    assert work is not None
    v = 100**2 + (150**2 - 100**2) + 50**2
    assert (work.u, work.v, work.steps, work.first) == (200, v, 2, True)
    assert work.seconds == pytest.approx(2 * 0.01 + 1e-3 * 200)


def test_a_target_whose_first_token_came_after_another_prompt_is_not_first() -> None:
    sent = [Sent(0.0, 50, 0, 10), Sent(0.0, 300, 0, 10)]  # A ends in step 1, B later
    later = burst_work(BUDGET_100, None, sent, 1, _cost(1e-3))
    assert later is not None and not later.first
    seconds = later.seconds
    assert burst_sample(BUDGET_100, None, sent, 1, seconds, 1e-3, 0.0, 0.01, 0.0) is None
    assert burst_work(BUDGET_100, None, sent, 0, _cost(1e-3)).first  # type: ignore[union-attr]


def test_the_fixed_point_recovers_a_from_arrivals_spread_over_the_steps() -> None:
    capped = SchedulerSettings(max_num_batched_tokens=256, max_num_seqs=8,
                               long_prefill_token_threshold=64)  # fmt: skip
    sent = [Sent(0.0, 400, 0, 50), Sent(0.003, 120, 0, 50), Sent(0.01, 300, 16, 50),
            Sent(0.02, 800, 0, 50)]  # fmt: skip
    a, b, over, per_seq = 2e-4, 1e-8, 0.005, 1e-4
    truth = burst_work(capped, None, sent, 1, _cost(a, b, over, per_seq))
    assert truth is not None and truth.first  # the 120-token prompt overtakes the 400
    for guess in (1e-3, 2e-5):  # 5× and 10× off
        work = burst_sample(capped, None, sent, 1, truth.seconds, guess, b, over, per_seq)
        assert work is not None
        solved = (truth.seconds - work.steps * over - work.decoders * per_seq - b * work.v) / work.u
        assert solved == pytest.approx(a, rel=0.02)
    # a first token too soon for the steps' overhead alone has no positive solution
    assert burst_sample(capped, None, sent, 1, 0.001, 1e-3, b, over, per_seq) is None


def test_a_fresh_worker_learns_from_the_first_first_token_of_a_burst() -> None:
    """Four prompts sent at once to an idle worker whose chunk cap (256) is below its budget
    (1024): the 300-token one is the first to finish, not the first sent. The time to its
    first token is a sample (no busy chain can end there), and it gives the true ``a``."""
    settings = SchedulerSettings(max_num_batched_tokens=1024, max_num_seqs=8,
                                 long_prefill_token_threshold=256)  # fmt: skip
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    reg = WorkerRegistration(
        worker_id="w0", model="m", engine="vllm", engine_version="x", block_size=16,
        scheduler=settings, endpoints=WorkerEndpoints(http_url="http://w0"), config_hash="c",
        ts=0.0,
    )  # fmt: skip
    index.register_worker(reg.worker_id, reg.model, reg.block_size)
    p.on_registration(reg)
    sizes = (2000, 300, 1500, 900)
    for i, n in enumerate(sizes):
        q = RouteRequest(request_id=f"r{i}", model="m", token_ids=tuple(range(i, i + n)),
                         expected_output_tokens=20)  # fmt: skip
        p.route(q.query(), 0.0, 0.0)
    step = p.fits.step_cost("w0")
    a = 3e-5
    sent = [Sent(0.0, n, 0, 20) for n in sizes]
    cost = _cost(a, REFERENCE_B_S_PER_TOKEN2, step.overhead_s, step.per_seq_s)
    truth = burst_work(settings, None, sent, 1, cost)
    assert truth is not None and truth.first
    assert p.fits.curve("w0").default
    p.on_outcome(Outcome(request_id="r1", ts=truth.seconds, kind="first_token", worker_id="w0",
                         actual_ttft_s=truth.seconds), truth.seconds)  # fmt: skip
    curve = p.fits.curve("w0")
    assert not curve.default and curve.a == pytest.approx(a, rel=0.02)
