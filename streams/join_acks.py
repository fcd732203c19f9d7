"""Acks of ``grants`` and ``outcomes`` held until the grading join has settled the request.

The grading join keeps a request's first side in memory until the other arrives. If the
worker acked (and Faust committed) a grant whose completion had not come yet and was then
killed, the restarted worker would never see that grant again: the completion would be an
orphan and the request would never be graded. So these agents ack an event only once the
join no longer holds its request (graded — the graded record emitted before the ack, and
Faust flushes its producer before it commits —, dropped as an orphan, or a duplicate).
Faust commits a partition only up to its first unacked event, so after a kill the worker
reads again from the oldest unsettled request: the requests graded since are graded a
second time, which the lake's views absorb (one row per request id).

Pure of Kafka beyond ``event``/``stream`` objects that have ``ack``: held events are kept
per request id; the join's ``pending`` mapping says what is still open.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

from foretoken.ids import RequestId


class HeldAcks:
    """Events (with the stream that delivered them) waiting for their request to settle."""

    def __init__(self, pending: Callable[[], Container[RequestId]]) -> None:
        self._pending = pending
        self._held: dict[RequestId, list[tuple[Any, Any]]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._held.values()))

    async def after(self, stream: Any, event: Any, request_id: RequestId | None) -> None:
        """Hold ``event`` while the join keeps ``request_id`` open; else ack it (and every
        event held for that request)."""
        if request_id is not None and request_id in self._pending():
            self._held.setdefault(request_id, []).append((stream, event))
            return
        await stream.ack(event)
        if request_id is not None:
            await self._release(request_id)

    async def release_settled(self) -> int:
        """Ack the held events of every request the join no longer holds (after expiry)."""
        pending = self._pending()
        settled = [rid for rid in self._held if rid not in pending]
        for rid in settled:
            await self._release(rid)
        return len(settled)

    async def _release(self, request_id: RequestId) -> None:
        for stream, event in self._held.pop(request_id, ()):
            await stream.ack(event)
