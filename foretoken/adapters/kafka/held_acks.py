"""Acks of ``grants`` and ``outcomes`` held until the grading join has settled the request.

The grading join keeps a request's first side in memory until the other arrives. If the
worker acked (and Faust committed) a grant whose completion had not come yet and was then
killed, the restarted worker would never see that grant again: the completion would be an
orphan and the request would never be graded. So these agents ack an event only once the
join no longer holds its request (graded — the graded record emitted before the ack, and
Faust flushes its producer before it commits —, dropped as an orphan, or a duplicate).

**In offset order.** Events are acked per partition strictly in the order they arrived: a
settled event waits behind an earlier one still open. Faust is meant to commit a partition
only up to its first unacked event, but its gap check is off by one (an unacked event right
at the committed offset, followed by acked ones, is committed past — the integration test
lost a request that way), so the acked offsets are kept a contiguous prefix and the
question never arises. After a kill the worker reads again from the oldest unsettled
request: the requests graded since are graded a second time, which the lake's views absorb
(one row per request id).

Pure of Kafka: ``stream`` is anything with ``async ack(event)``; the join's ``pending``
mapping says which requests are still open.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from foretoken.core.types import RequestId

Lane = tuple[int, int]  # (id of the stream, partition)


@dataclass(slots=True)
class _Held:
    event: Any
    request_id: RequestId | None
    settled: bool


class HeldAcks:
    """Per (stream, partition), the events not acked yet, in arrival (= offset) order."""

    def __init__(self, pending: Callable[[], Container[RequestId]]) -> None:
        self._pending = pending
        self._lanes: dict[Lane, tuple[Any, deque[_Held]]] = {}
        self._open: dict[RequestId, list[tuple[Lane, _Held]]] = {}

    def __len__(self) -> int:
        return sum(len(queue) for _, queue in self._lanes.values())

    async def after(
        self, stream: Any, event: Any, partition: int, request_id: RequestId | None
    ) -> None:
        """``event`` (of ``partition``, delivered by ``stream``) was handled: ack it, and
        whatever it settled, as far as the offset order allows."""
        lane: Lane = (id(stream), partition)
        queue = self._lanes.setdefault(lane, (stream, deque()))[1]
        is_open = request_id is not None and request_id in self._pending()
        held = _Held(event, request_id, settled=not is_open)
        queue.append(held)
        touched = {lane}
        if is_open:
            assert request_id is not None
            self._open.setdefault(request_id, []).append((lane, held))
        elif request_id is not None:
            touched |= self._settle(request_id)
        for each in touched:
            await self._drain(each)

    async def release_settled(self) -> int:
        """Settle every request the join no longer holds (after its expiry); returns how
        many requests were settled."""
        pending = self._pending()
        settled = [rid for rid in self._open if rid not in pending]
        touched: set[Lane] = set()
        for rid in settled:
            touched |= self._settle(rid)
        for lane in touched:
            await self._drain(lane)
        return len(settled)

    def _settle(self, request_id: RequestId) -> set[Lane]:
        lanes = set()
        for lane, held in self._open.pop(request_id, ()):
            held.settled = True
            lanes.add(lane)
        return lanes

    async def _drain(self, lane: Lane) -> None:
        stream, queue = self._lanes[lane]
        while queue and queue[0].settled:
            await stream.ack(queue.popleft().event)
