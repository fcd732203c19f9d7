"""A prompt held back by a full engine (every seat taken, or its KV blocks do not fit)
starts at the completion that frees room; if nothing else can start beside it, its
prefill runs alone beside decoders from that completion to its first token: a sample of
the prefill curve on an engine that is never idle."""

from __future__ import annotations

import pytest

from foretoken.core.cost.fit import REFERENCE_B_S_PER_TOKEN2
from foretoken.core.routing.service import RouteService
from foretoken.wire.records import Outcome, SchedulerSettings
from foretoken.wire.route_rpc import RouteRequest
from tests.unit.core.routing.one_worker import one_worker

A = 6e-5  # the engine's true s per token


def _two_seats() -> RouteService:
    return one_worker(SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=2))


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


def _fill(p: RouteService) -> float:
    """a and b (1000 tokens) fill both seats and prefill in one step, c (3000) waits for a
    seat; a's and b's first tokens come. Their TTFT."""
    for rid, lo, n in (("a", 0, 1000), ("b", 5000, 1000), ("c", 10_000, 3000)):
        req = RouteRequest(request_id=rid, model="m", token_ids=tuple(range(lo, lo + n)))
        assert p.route(req.query(), 0.0, 0.0).worker_id == "w0"
    step = p.fits.step_cost("w0")
    t_ab = step.overhead_s + A * 2000 + REFERENCE_B_S_PER_TOKEN2 * 2 * 1000**2
    _first(p, "a", t_ab)
    _first(p, "b", t_ab)
    return t_ab


def _done(p: RouteService, rid: str, ts: float, ttft: float) -> None:
    p.on_outcome(Outcome(request_id=rid, ts=ts, kind="completion", worker_id="w0",
                         actual_ttft_s=ttft, output_tokens=100, e2e_s=ts), ts)  # fmt: skip


def _busy(p: RouteService) -> int:
    return int(p.fits.describe()[0]["busy_observed"])  # type: ignore[call-overload]


def test_a_seat_blocked_prompt_is_timed_from_the_completion_that_let_it_start() -> None:
    p = _two_seats()
    _done(p, "a", 2.0, _fill(p))  # c waited for a seat until a completed at 2 s
    before = _busy(p)
    # c's 3000 tokens in two steps (2048 + 952) beside b's decode, from a's completion
    _first(p, "c", 2.0 + _prefill(3000, 2, 1, p))
    assert _busy(p) == before + 1
    curve = p.fits.curve("w0")
    assert curve.a == pytest.approx(A, rel=0.05)  # not the 2 s c waited for its seat


def test_a_prompt_another_could_join_is_not_sampled() -> None:
    """The same, but with a fourth prompt routed after a's completion: it may share c's
    steps, so c's time is not its own."""
    p = _two_seats()
    t_ab = _fill(p)
    _done(p, "b", 1.9, t_ab)
    # c started alone at 1.9 (a still decodes); a's completion at 2.0 frees the seat d takes
    d = RouteRequest(request_id="d", model="m", token_ids=tuple(range(20_000, 21_000)))
    p.route(d.query(), 1.95, 1.95)
    _done(p, "a", 2.0, t_ab)
    before = _busy(p)
    _first(p, "c", 1.9 + _prefill(3000, 2, 1, p) + 0.3)
    assert _busy(p) == before
