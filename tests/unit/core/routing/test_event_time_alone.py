"""Whether a request ran alone is judged in event time: live, a first token reaches the
route service through Kafka after the client already sent its next request, and the pair
overlapped only if that first token came after the next send (the router's clock)."""

from __future__ import annotations

from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.routing.service import RouteService
from foretoken.core.types import RequestId, WorkerId, WorkerProfile
from foretoken.wire.records import Graded, Outcome, SchedulerSettings
from foretoken.wire.route_rpc import RouteRequest
from tests.unit.core.routing.one_worker import one_worker

W = WorkerId("w")
A, B, C = RequestId("a"), RequestId("b"), RequestId("c")
SERIAL = SchedulerSettings(max_num_batched_tokens=8192, max_num_seqs=1, chunked_prefill=False)


def _book() -> WorkerBook:
    book = WorkerBook()
    book.apply(WorkerProfile(worker_id=W, model="m", engine="llama.cpp", engine_version="x",
                             block_size=16, config_hash="h", ts=0.0, scheduler=SERIAL))  # fmt: skip
    return book


def test_a_first_token_heard_late_but_before_the_next_send_leaves_both_alone() -> None:
    book = _book()
    book.enqueue(W, A, 0.0, 1000, 0, 1)
    book.enqueue(W, B, 0.5, 1000, 0, 1)  # a's first token (0.4) not heard of yet
    assert book.unresolved[B] == 1  # undecided: no sample while a is not heard of
    book.started(A, 0.4)
    book.started(B, 0.9)
    assert book.ran_alone(A) and book.ran_alone(B)


def test_a_first_token_after_the_next_send_spoils_both() -> None:
    book = _book()
    book.enqueue(W, A, 0.0, 1000, 0, 1)
    book.enqueue(W, B, 0.3, 1000, 0, 1)
    book.started(A, 0.4)
    assert not book.ran_alone(A) and not book.ran_alone(B)


def test_a_request_whose_predecessor_is_never_heard_of_is_no_sample() -> None:
    book = _book()
    book.enqueue(W, A, 0.0, 1000, 0, 1)
    book.enqueue(W, B, 0.5, 1000, 0, 1)
    book.started(B, 0.9)
    assert not book.ran_alone(B)  # a may have prefilled beside it
    book.expire(100.0, 10.0)  # a's outcome never came: it expires, b is forgotten too
    assert not book.alone and not book.sent_beside and not book.unresolved


def test_a_withdrawn_request_spoils_nothing() -> None:
    book = _book()
    book.enqueue(W, A, 0.0, 1000, 0, 1)
    book.enqueue(W, B, 0.1, 1000, 0, 1)
    book.withdraw(A)  # never reached the engine
    book.started(B, 0.9)
    assert book.ran_alone(B)
    assert not book.sent_beside and not book.unresolved


def _graded(rid: str, n: int, ts: float, ttft: float) -> Graded:
    return Graded(request_id=rid, ts=ts, model="m", workload_class="d", worker_id="w0",
                  status="served", admitted=True, prompt_tokens=n, actual_ttft_s=ttft,
                  engine_cached_tokens=0, queue_tokens_ahead=n)  # type: ignore[arg-type]  # fmt: skip


def _serve_stale(p: RouteService, gap_s: float) -> int:
    """One request after another, each sent ``gap_s`` after the previous first token and
    completion, but routed before the route service hears of them; returns the samples."""
    a, b = 4e-5, 2e-9
    t, samples = 0.0, 0
    sizes = [1000, 2000, 4000, 8000, 3000, 6000, 5000, 7000, 1500, 2500]
    pending: list[tuple[str, int, float, float]] = []
    for i, n in enumerate(sizes):
        rid = f"s{i}"
        assert p.route(RouteRequest(request_id=rid, model="m", token_ids=tuple(range(n))).query(),
                       t, t).admitted  # fmt: skip
        for prid, pn, pt, pttft in pending:  # the previous request's outcomes, heard late
            for kind in ("first_token", "completion"):
                p.on_outcome(Outcome(request_id=prid, ts=pt + pttft, kind=kind, worker_id="w0",
                                     actual_ttft_s=pttft, e2e_s=pttft, output_tokens=1,
                                     engine_cached_tokens=0), t)  # type: ignore[arg-type]  # fmt: skip
            samples += p.on_graded(_graded(prid, pn, pt, pttft), t)
        ttft = a * n + b * n * n
        pending = [(rid, n, t, ttft)]
        t += ttft + gap_s
    return samples


def test_a_serial_client_heard_late_still_teaches_the_fit() -> None:
    p = one_worker(SERIAL)
    assert _serve_stale(p, 0.02) == 9
    assert not p.fits.curve(WorkerId("w0")).default
    # the same sends, each before the previous first token: none ran alone
    assert _serve_stale(one_worker(SERIAL), -0.01) == 0


def test_first_tokens_later_than_predicted_lengthen_the_next_queue_wait() -> None:
    """The route service's own decisions teach the worker's wait scale: a queue that
    drains 1.8x slower than the walk said makes the next prediction's wait longer."""
    p = one_worker(SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8))
    wid = WorkerId("w0")
    t = 0.0

    scale = p.predictions.wait_scale
    assert scale is not None

    def wait_of(rid: str) -> tuple[float, float]:
        """The walk's own wait (the prediction's, less the scale) and prefill."""
        k = scale.factor(wid)
        d = p.route(RouteRequest(request_id=rid, model="m",
                                 token_ids=tuple(range(8192))).query(), t, t)  # fmt: skip
        assert d.queue_wait_s is not None and d.predicted_ttft_s is not None
        return d.queue_wait_s / k, d.predicted_ttft_s - d.queue_wait_s

    for i in range(40):
        rids = [f"b{i}-{j}" for j in range(4)]
        waits = [wait_of(r) for r in rids]  # a burst: each waits behind the ones before
        for rid, (wait, own) in zip(rids, waits, strict=True):
            actual = own + 1.8 * wait
            for kind in ("first_token", "completion"):
                p.on_outcome(Outcome(request_id=rid, ts=t + actual, kind=kind, worker_id="w0",
                                     actual_ttft_s=actual, e2e_s=actual, output_tokens=1),
                             t + actual)  # type: ignore[arg-type]  # fmt: skip
        t += 100.0
    assert 1.3 < scale.factor(wid) <= 1.8
