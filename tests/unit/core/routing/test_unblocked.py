"""A prompt held back by a full engine (every seat taken, or its KV blocks do not fit)
starts at the completion that frees room; if nothing else can start beside it, its
prefill runs alone beside decoders from that completion to its first token: a sample of
the prefill curve on an engine that is never idle."""

from __future__ import annotations

import pytest

from foretoken.core.cost.fit import REFERENCE_B_S_PER_TOKEN2
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.wire.records import (
    Outcome,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest

A = 6e-5  # the engine's true s per token


def _two_seats() -> RouteService:
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    reg = WorkerRegistration(
        worker_id="w0", model="m", engine="vllm", engine_version="x", block_size=16,
        scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=2),
        endpoints=WorkerEndpoints(http_url="http://w0"), config_hash="c", ts=0.0,
    )  # fmt: skip
    index.register_worker(reg.worker_id, reg.model, reg.block_size)
    p.on_registration(reg)
    return p


def _prefill(n: int, steps: int, decoding: int, p: RouteService) -> float:
    step = p.fits.step_cost("w0")
    return (
        steps * (step.overhead_s + step.per_seq_s * decoding)
        + A * n
        + (REFERENCE_B_S_PER_TOKEN2 * n * n)
    )


def _first(p: RouteService, rid: str, ts: float) -> None:
    p.on_outcome(Outcome(request_id=rid, ts=ts, kind="first_token", worker_id="w0",
                         actual_ttft_s=ts), ts)  # fmt: skip


def _run(p: RouteService, c_first_at: float) -> tuple[int, int]:
    """a and b (1000 tokens) fill both seats and prefill in one step; c (3000) waits for a
    seat until a completes at 2 s. The busy samples before and after c's first token."""
    for rid, lo, n in (("a", 0, 1000), ("b", 5000, 1000), ("c", 10_000, 3000)):
        req = RouteRequest(request_id=rid, model="m", token_ids=tuple(range(lo, lo + n)))
        assert p.route(req.query(), 0.0, 0.0).worker_id == "w0"
    step = p.fits.step_cost("w0")
    t_ab = step.overhead_s + A * 2000 + REFERENCE_B_S_PER_TOKEN2 * 2 * 1000**2
    _first(p, "a", t_ab)
    _first(p, "b", t_ab)
    p.on_outcome(Outcome(request_id="a", ts=2.0, kind="completion", worker_id="w0",
                         actual_ttft_s=t_ab, output_tokens=100, e2e_s=2.0), 2.0)  # fmt: skip
    before = p.fits.describe()[0]["busy_observed"]
    _first(p, "c", c_first_at)
    after = p.fits.describe()[0]["busy_observed"]
    return int(before), int(after)  # type: ignore[call-overload]


def test_a_seat_blocked_prompt_is_timed_from_the_completion_that_let_it_start() -> None:
    p = _two_seats()
    # c's 3000 tokens in two steps (2048 + 952) beside b's decode, from a's completion
    before, after = _run(p, 2.0 + _prefill(3000, 2, 1, p))
    assert after == before + 1
    curve = p.fits.curve("w0")
    assert curve.a == pytest.approx(A, rel=0.05)  # not the 2 s c waited for its seat


def test_a_prompt_another_could_join_is_not_sampled() -> None:
    """The same, but with a fourth prompt routed after a's completion: it may share c's
    steps, so c's time is not its own."""
    p = _two_seats()
    for rid, lo, n in (("a", 0, 1000), ("b", 5000, 1000), ("c", 10_000, 3000)):
        req = RouteRequest(request_id=rid, model="m", token_ids=tuple(range(lo, lo + n)))
        p.route(req.query(), 0.0, 0.0)
    step = p.fits.step_cost("w0")
    t_ab = step.overhead_s + A * 2000 + REFERENCE_B_S_PER_TOKEN2 * 2 * 1000**2
    _first(p, "a", t_ab)
    _first(p, "b", t_ab)
    p.on_outcome(Outcome(request_id="b", ts=1.9, kind="completion", worker_id="w0",
                         actual_ttft_s=t_ab, output_tokens=100, e2e_s=1.9), 1.9)  # fmt: skip
    # c started alone at 1.9 (a still decodes); a's completion at 2.0 frees the seat d takes
    d = RouteRequest(request_id="d", model="m", token_ids=tuple(range(20_000, 21_000)))
    p.route(d.query(), 1.95, 1.95)
    p.on_outcome(Outcome(request_id="a", ts=2.0, kind="completion", worker_id="w0",
                         actual_ttft_s=t_ab, output_tokens=100, e2e_s=2.0), 2.0)  # fmt: skip
    before = p.fits.describe()[0]["busy_observed"]
    _first(p, "c", 1.9 + _prefill(3000, 2, 1, p) + 0.3)
    assert p.fits.describe()[0]["busy_observed"] == before
