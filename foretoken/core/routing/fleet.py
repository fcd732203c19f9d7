"""The route service's book of workers: what each one said about itself (its profile) and
the queue model of what was sent there (:class:`~foretoken.core.queue.worker_queue.WorkerQueue`).

It also marks whether a request ran *alone* (no other prompt waiting or prefilling there
from its send to its first token): such a request's TTFT is its prefill time, a sample for
the fits (:mod:`foretoken.core.routing.learn`). That is judged in event time, by the
router's clock: live, a first token reaches the route service through Kafka some
milliseconds after it happened, and a client sending one request after another sends the
next one before the route service hears of the previous one's first token (a llama.cpp
engine driven that way gave 3 prefill samples in 2 minutes). So a request sent while
another still looks unstarted is not written off at once: the pair overlapped only if the
other's first token, when it is heard of, came after this one's send.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Final

from foretoken.core.queue.scheduler import KvModel
from foretoken.core.queue.tails import OutputTail
from foretoken.core.queue.worker_queue import WorkerQueue
from foretoken.core.routing.sharing import RecentSends
from foretoken.core.types import RequestId, WorkerId, WorkerProfile

# Up to this many unstarted requests on a worker, a send beside them is judged in event time
# (:meth:`WorkerBook.started`); with more, it overlapped them (it is not a sample either way).
MAX_DEFERRED: Final = 4


class WorkerBook:
    """``model_kv_capacity``: queue models hold each running request's KV blocks against
    the worker's reported ``gpu_blocks`` (admission waits, as the engine's does)."""

    def __init__(self, *, model_kv_capacity: bool = True) -> None:
        self.model_kv_capacity = model_kv_capacity
        self.profiles: dict[WorkerId, WorkerProfile] = {}
        self.queues: dict[WorkerId, WorkerQueue] = {}
        self.alone: dict[RequestId, bool] = {}  # nothing else ran there before its first token
        # an unstarted request -> the requests sent beside it before its first token was
        # heard of, with their send times (judged at its first token, :meth:`started`)
        self.sent_beside: dict[RequestId, list[tuple[RequestId, float]]] = {}
        self.unresolved: dict[RequestId, int] = {}  # how many of those lists hold it
        # per worker, the last request sent when nothing waited or prefilled there and a
        # seat was free, and when: the engine started on it at once, and worked without a
        # pause on it and what was sent after it until its queue drained (a clean busy
        # chain's known start, :mod:`foretoken.core.cost.busy_chains`)
        self.idle_start: dict[WorkerId, tuple[RequestId, float]] = {}
        # per worker, the last requests sent there (:mod:`foretoken.core.routing.sharing`)
        self.recent = RecentSends()

    def apply(self, profile: WorkerProfile) -> None:
        """A registration: a new worker, new scheduler settings, or (``removed``) gone."""
        wid = profile.worker_id
        if profile.removed:
            self.profiles.pop(wid, None)
            self.queues.pop(wid, None)
            self.recent.forget_worker(wid)
            return
        self.profiles[wid] = profile
        queue = self.queues.get(wid)
        if queue is None:
            self.queues[wid] = WorkerQueue(profile.scheduler, kv=self._kv_model(profile))
        elif queue.settings != profile.scheduler:
            queue.set_settings(profile.scheduler)

    def _kv_model(self, profile: WorkerProfile) -> KvModel | None:
        if not self.model_kv_capacity or profile.gpu_blocks is None:
            return None
        return KvModel(profile.gpu_blocks, profile.block_size)

    def of_model(self, model: str) -> Iterator[WorkerProfile]:
        return (p for p in self.profiles.values() if p.model == model)

    def serves(self, model: str) -> bool:
        return any(True for _ in self.of_model(model))

    def idle(self, wid: WorkerId) -> bool:
        """Nothing waiting or prefilling there (requests only decoding are allowed)."""
        return self.queues[wid].unstarted_count == 0

    def has_capacity(self, wid: WorkerId) -> bool:
        """Room for one more running sequence (what the engine will let in)."""
        queue = self.queues.get(wid)
        profile = self.profiles.get(wid)
        if queue is None or profile is None:
            return False
        return queue.outstanding_count < profile.scheduler.max_num_seqs

    def enqueue(
        self, wid: WorkerId, rid: RequestId, sent_s: float, n: int, cached: int, expected: int,
        pinned: int = -1, tail: OutputTail | None = None,
    ) -> None:  # fmt: skip
        """A request sent there (idempotent by request id). "Alone" for a prefill sample: no
        other prompt waiting or prefilling when it was sent, and none sent before its first
        token — by event time (:meth:`started`). Requests only decoding are allowed: under
        steady load a worker is rarely empty, and a decode adds milliseconds per step to a
        prefill of hundreds or more."""
        queue = self.queues.get(wid)
        if queue is None:
            return
        was_idle = self.idle(wid)
        seat = self.has_capacity(wid)
        if queue.add(rid, sent_s, n, cached, expected, pinned, tail):
            self.recent.sent(wid, sent_s, n - cached)
            if was_idle and seat:
                self.idle_start[wid] = (rid, sent_s)
            unstarted = [o.request_id for o in queue.outstanding()
                         if o.request_id != rid and o.first_token_s is None]  # fmt: skip
            deferred = len(unstarted) <= MAX_DEFERRED
            for other in unstarted:
                if deferred:
                    self.sent_beside.setdefault(other, []).append((rid, sent_s))
                    self.unresolved[rid] = self.unresolved.get(rid, 0) + 1
                else:
                    self.alone[other] = False
            self.alone[rid] = deferred

    def reestimate(
        self, expected: Callable[[RequestId], int | None],
        tail: Callable[[RequestId], OutputTail | None] | None = None,
    ) -> int:  # fmt: skip
        """New expected output lengths and tails (:meth:`WorkerQueue.reestimate`) in every
        queue; how many queues changed."""
        return sum(queue.reestimate(expected, tail) for queue in self.queues.values())

    def started(self, rid: RequestId, t: float) -> None:
        """``rid``'s first token came at ``t`` (or it ended then without one): the requests
        sent beside it before ``t`` overlapped its prefill, and it theirs."""
        for other, sent_s in self.sent_beside.pop(rid, ()):
            left = self.unresolved.pop(other, 1) - 1
            if left > 0:
                self.unresolved[other] = left
            if sent_s < t:
                if other in self.alone:
                    self.alone[other] = False
                if rid in self.alone:
                    self.alone[rid] = False

    def ran_alone(self, rid: RequestId) -> bool:
        """Whether ``rid`` ran alone, forgetting it; False while a request it was sent
        beside has not been heard of starting."""
        alone = self.alone.pop(rid, False)
        return alone and self.unresolved.pop(rid, 0) == 0

    def expire(self, now_s: float, max_age_s: float) -> list[RequestId]:
        """Requests whose outcome never came, forgotten by every queue."""
        gone: list[RequestId] = []
        for queue in self.queues.values():
            for rid in queue.expire(now_s, max_age_s):
                self.alone.pop(rid, None)
                self.started(rid, now_s)  # it may have run beside those sent after it
                self.withdraw_idle_start(rid)
                gone.append(rid)
        return gone

    def withdraw(self, rid: RequestId) -> None:
        """``rid`` never reached its worker (overruled, or never acted on): forget it."""
        self.alone.pop(rid, None)
        self.unresolved.pop(rid, None)
        self.withdraw_idle_start(rid)

    def withdraw_idle_start(self, rid: RequestId) -> None:
        """``rid`` never reached its worker: the engine did not start on it."""
        self.started(rid, -math.inf)  # it overlapped nothing
        for wid, (started, _) in list(self.idle_start.items()):
            if started == rid:
                del self.idle_start[wid]
