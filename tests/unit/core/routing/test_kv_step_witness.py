"""Which requests vouch for an engine step timed by two KV batches (core/cost/kv_steps.py):
a decision nobody acted on does not; a request whose grant came back does at once; a first
token witnesses the steps its request waited through.

The scene of the CI failure: decisions only asked for at ``/v1/route`` sit in the queue
model, and requests sent one after another to the idle worker leave gaps between its
batches (the client reading the answer) that must not read as steps.
"""

from __future__ import annotations

from foretoken.core.routing.service import RouteService
from foretoken.wire.records import Outcome
from tests.unit.core.routing.test_kv_progress import _prompt, _service, _stores


def _asked_only(service: RouteService, k: int) -> None:
    """``k`` decisions of 8,000 tokens nobody acted on (no grant comes back)."""
    for i in range(k):
        service.route(_prompt(f"asked{i}", 8_000).query(), 0.0, 0.0)
    assert service.book.queues["w0"].unstarted_count == k  # type: ignore[index]


def _busy_observed(service: RouteService) -> int:
    fits = service.fits.fits("w0")  # type: ignore[arg-type]
    assert fits is not None
    return fits.busy.observed if fits.busy is not None else 0


def _first_token(rid: str, ts: float) -> Outcome:
    return Outcome(request_id=rid, ts=ts, kind="first_token", worker_id="w0", actual_ttft_s=0.05)  # type: ignore[arg-type]


def test_gaps_between_sequential_requests_are_no_steps_while_asked_decisions_wait() -> None:
    service = _service(kv_progress_samples=False)
    _asked_only(service, 20)
    t, seq = 1.0, 0
    for i in range(6):  # one 80-token request at a time: one prefill batch, a first token
        grant = service.route(_prompt(f"r{i}", 80).query(), t, t)
        service.on_grant(grant, t)
        service.on_kv_batch(_stores(seq, t + 0.01, 100 * i, 5), t + 0.01)
        service.on_outcome(_first_token(f"r{i}", t + 0.012), t + 0.013)
        t, seq = t + 0.1, seq + 1  # the client reads the answer, then sends the next one
    assert service.learner.kv_steps.samples == 0
    assert _busy_observed(service) == 0


def test_a_request_whose_grant_came_back_vouches_at_once() -> None:
    service = _service(kv_progress_samples=False)
    grant = service.route(_prompt("long", 16_000).query(), 0.0, 0.0)
    service.on_kv_batch(_stores(0, 0.04, 0, 128), 0.04)
    service.on_kv_batch(_stores(1, 0.08, 128, 128), 0.08)
    assert service.learner.kv_steps.samples == 0  # not acted on yet: held
    service.on_grant(grant, 0.081)
    service.on_kv_batch(_stores(2, 0.12, 256, 128), 0.12)
    assert service.learner.kv_steps.samples == 1  # the step 0.08 -> 0.12, at once
    # its first token witnesses the held step 0.04 -> 0.08 too
    service.on_outcome(_first_token("long", 0.5), 0.5)
    assert service.learner.kv_steps.samples == 2
    assert _busy_observed(service) >= 2  # (a first token may close a busy chain too)
