"""The route service's book of workers: what each one said about itself (its profile) and
the queue model of what was sent there (:class:`~foretoken.core.queue.worker_queue.WorkerQueue`).

It also marks, when a request is enqueued, whether it will have run *alone* (no other
prompt waiting or prefilling there from its send to its first token): such a request's
TTFT is its prefill time, a sample for the fits (:mod:`foretoken.core.routing.learn`).
"""

from __future__ import annotations

from collections.abc import Iterator

from foretoken.core.queue.scheduler import KvModel
from foretoken.core.queue.worker_queue import WorkerQueue
from foretoken.core.types import RequestId, WorkerId, WorkerProfile


class WorkerBook:
    """``model_kv_capacity``: queue models hold each running request's KV blocks against
    the worker's reported ``gpu_blocks`` (admission waits, as the engine's does)."""

    def __init__(self, *, model_kv_capacity: bool = True) -> None:
        self.model_kv_capacity = model_kv_capacity
        self.profiles: dict[WorkerId, WorkerProfile] = {}
        self.queues: dict[WorkerId, WorkerQueue] = {}
        self.alone: dict[RequestId, bool] = {}  # nothing else ran there before its first token
        # per worker, the last request sent when nothing waited or prefilled there and a
        # seat was free, and when: the engine started on it at once, and worked without a
        # pause on it and what was sent after it until its queue drained (a clean busy
        # chain's known start, :mod:`foretoken.core.cost.busy_chains`)
        self.idle_start: dict[WorkerId, tuple[RequestId, float]] = {}

    def apply(self, profile: WorkerProfile) -> None:
        """A registration: a new worker, new scheduler settings, or (``removed``) gone."""
        wid = profile.worker_id
        if profile.removed:
            self.profiles.pop(wid, None)
            self.queues.pop(wid, None)
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
        self, wid: WorkerId, rid: RequestId, sent_s: float, n: int, cached: int, expected: int
    ) -> None:
        """A request sent there (idempotent by request id). "Alone" for a prefill sample: no
        other prompt waiting or prefilling when it was sent, and none sent before its first
        token. Requests only decoding are allowed: under steady load a worker is rarely
        empty, and a decode adds milliseconds per step to a prefill of hundreds or more."""
        queue = self.queues.get(wid)
        if queue is None:
            return
        was_idle = self.idle(wid)
        seat = self.has_capacity(wid)
        if queue.add(rid, sent_s, n, cached, expected):
            if was_idle and seat:
                self.idle_start[wid] = (rid, sent_s)
            for other in queue.outstanding():
                if other.request_id != rid and other.first_token_s is None:
                    self.alone[other.request_id] = False
            self.alone[rid] = was_idle

    def expire(self, now_s: float, max_age_s: float) -> list[RequestId]:
        """Requests whose outcome never came, forgotten by every queue."""
        gone: list[RequestId] = []
        for queue in self.queues.values():
            for rid in queue.expire(now_s, max_age_s):
                self.alone.pop(rid, None)
                self.withdraw_idle_start(rid)
                gone.append(rid)
        return gone

    def withdraw_idle_start(self, rid: RequestId) -> None:
        """``rid`` never reached its worker: the engine did not start on it."""
        for wid, (started, _) in list(self.idle_start.items()):
            if started == rid:
                del self.idle_start[wid]
