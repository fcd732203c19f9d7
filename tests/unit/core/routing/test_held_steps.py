"""A stream's decode step, timed while prompts waited for their prefill as its window
closed, may have carried a chunk. Whether it did is judged on the prefill curve; a
worker still on the default curve holds such steps until it has one (the default's ``a``
reads a step of 60 ms, a chunk's worth, as decode-only)."""

from __future__ import annotations

import pytest

from foretoken.core.routing.service import RouteService
from foretoken.wire.records import Outcome, SchedulerSettings
from foretoken.wire.route_rpc import RouteRequest
from tests.unit.core.routing.one_worker import one_worker


def _service() -> RouteService:
    return one_worker(SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=64))


def _send(p: RouteService, rid: str, n: int, t: float) -> None:
    lo = 10_000 * (1 + len(p.decisions))
    req = RouteRequest(request_id=rid, model="m", token_ids=tuple(range(lo, lo + n)))
    assert p.route(req.query(), t, t).worker_id == "w0"


def _out(p: RouteService, rid: str, kind: str, ts: float, step_s: float | None = None) -> None:
    done = {"output_tokens": 50, "e2e_s": ts, "decode_step_s": step_s}
    extra = done if kind == "completion" else {}
    p.on_outcome(Outcome(request_id=rid, ts=ts, kind=kind, worker_id="w0",  # type: ignore[arg-type]
                         actual_ttft_s=0.1, **extra), ts)  # fmt: skip


def _samples(p: RouteService) -> int:
    return int(p.fits.describe()[0]["step_samples"])  # type: ignore[call-overload]


@pytest.mark.parametrize(("step_s", "kept"), [(0.012, 1), (0.06, 0)])
def test_a_step_timed_while_prompts_waited_is_judged_once_the_curve_is_learned(
    step_s: float, kept: int
) -> None:
    p = _service()
    _send(p, "r", 500, 0.0)
    for k in range(6):  # 60,000 tokens queued behind r: every step carries a chunk
        _send(p, f"q{k}", 10_000, 0.0)
    _out(p, "r", "first_token", 0.001)  # too soon to be a prefill sample
    _out(p, "r", "completion", 1.0, step_s)  # prompts still wait for theirs
    assert p.fits.curve("w0").default and _samples(p) == 0  # held
    for k in range(10):  # the curve is learned: a = 2e-5 s per token
        n = 1000 + 700 * k
        p.fits.observe_cold("w0", "c", n, 2e-5 * n, 1.0)
    assert not p.fits.curve("w0").default
    _send(p, "s", 500, 1.0)  # a stream with nothing waiting: decode-only
    for rid, kind, ts in (("q0", "first_token", 1.1), ("q1", "first_token", 1.2),
                          ("q2", "first_token", 1.3), ("q3", "first_token", 1.4),
                          ("q4", "first_token", 1.5), ("q5", "first_token", 1.6),
                          ("s", "first_token", 1.7)):  # fmt: skip
        _out(p, rid, kind, ts)
    _out(p, "s", "completion", 2.0, 0.012)
    # the held step is judged at a = 2e-5: a 2048-token chunk is 40 ms, so 60 ms carried one
    assert _samples(p) == 1 + kept


@pytest.mark.parametrize(("step_s", "served_within", "kept"),
                         [(0.012, 6, 1), (0.06, 6, 0), (0.06, 1, 1)])  # fmt: skip
def test_a_step_of_a_stream_that_opened_idle_is_judged_when_chunks_filled_its_steps(
    step_s: float, served_within: int, kept: int
) -> None:
    """Prompts that arrive while a stream decodes make its steps carry their chunks just the
    same: on ``poisson-long/random-2/1.0`` (cache-aware routing, its queue on one worker)
    such steps, taken as decode-only, read a step overhead of 88–106 ms against a true
    7.7 ms, ``a`` fell to 1.5 µs against 47, and within 1 s was 75.5% (97.8% judged). A
    stream whose window saw chunks for fewer than half its steps (its median gap carried
    none) is not judged."""
    p = _service()
    for k in range(10):  # the curve is learned: a = 2e-5 s per token
        n = 1000 + 700 * k
        p.fits.observe_cold("w0", "c", n, 2e-5 * n, 1.0)
    _send(p, "r", 500, 2.0)
    _out(p, "r", "first_token", 2.001)  # its window (49 steps) opens with nothing waiting
    for k in range(7):  # then 70,000 tokens come: chunks of 2,048 tokens
        _send(p, f"q{k}", 10_000, 2.01)
    for k in range(served_within):  # served within the window: 10,000 tokens each
        _out(p, f"q{k}", "first_token", 2.2 + 0.1 * k)
    _out(p, "r", "completion", 3.0, step_s)  # and prompts still wait at its close
    # judged at a = 2e-5: a 2048-token chunk is 40 ms, so 60 ms carried one
    assert _samples(p) == kept
