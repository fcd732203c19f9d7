"""The book marks where a clean busy chain starts: a send to an idle engine."""

from __future__ import annotations

from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.types import RequestId, WorkerId, WorkerProfile
from foretoken.wire.records import SchedulerSettings

W = WorkerId("w")


def _book() -> WorkerBook:
    book = WorkerBook()
    book.apply(WorkerProfile(worker_id=W, model="m", engine="vllm", engine_version="x",
                             block_size=16, config_hash="h", ts=0.0,
                             scheduler=SchedulerSettings(max_num_batched_tokens=512)))  # fmt: skip
    return book


def test_only_a_send_to_an_idle_engine_starts_a_clean_chain_and_a_withdrawal_undoes_it() -> None:
    book = _book()
    book.enqueue(W, RequestId("a"), 1.0, 100, 0, 8)
    assert book.idle_start[W] == (RequestId("a"), 1.0)
    book.enqueue(W, RequestId("b"), 1.2, 100, 0, 8)  # a still waits: not idle
    assert book.idle_start[W] == (RequestId("a"), 1.0)
    book.withdraw_idle_start(RequestId("b"))
    assert W in book.idle_start
    book.withdraw_idle_start(RequestId("a"))  # it never reached the engine
    assert W not in book.idle_start
