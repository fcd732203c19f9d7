"""The router's client of several route services (read replicas, shards by model).

Where the route services are: ``router.route_urls`` (static), and with
``router.route_members`` the ready route replicas of the same deployment (consumer groups
``<app_id>-route…``) found on the ``members`` topic. With one URL and no discovery this is
exactly the single call of before: one attempt, ``router.route_timeout_s``.

Per request, :meth:`RouteClient.post` tries the services in this order, each attempt with an
equal share of what is left of ``router.route_timeout_s``, and yields the first answer that
is not a failure (a 5xx, a 421, a timeout, a refused or reset connection are failures; a
400 is an answer: every replica would say the same):

* sharded by model: the model's owner first (from the members' partitions), the others
  after (they forward to it);
* a request of a conversation starts at the replica its id hashes to — that replica holds
  the conversation's stickiness (the route service's memory of where it ran), so it stays
  on the worker that has its history;
* any other starts at the next replica in turn (round robin).

Only ready services are tried: each one's ``/healthz`` is checked every
``router.route_health_interval_s`` (a route replica answers 503 while it catches up), and
one that fails a request is skipped for ``router.route_retry_after_failure_s`` or until its
health check passes again. When none is ready or all fail, the router's own fallback decides
(``decide`` in ``router/app.py``), as when its single route service was down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from foretoken.adapters.kafka.members import ALIVE_INTERVALS, MembersView, follow_members
from foretoken.settings import Settings

log = logging.getLogger(__name__)
HEADERS = {"Content-Type": "application/msgpack"}


class NoRouteService(aiohttp.ClientError):
    """No route service is ready (the router decides alone)."""


@dataclass
class RouteService:
    url: str
    static: bool = True
    ready: bool | None = None  # None: not checked yet (tried)
    skip_until: float = 0.0  # monotonic: after a failed request
    answered: int = 0
    failed: int = 0

    def usable(self, now: float) -> bool:
        return self.ready is not False and now >= self.skip_until


@dataclass
class RouteClient:
    settings: Settings
    services: dict[str, RouteService] = field(default_factory=dict)
    members: MembersView | None = None
    failovers: int = 0
    _turn: Any = field(default_factory=itertools.count)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=lambda: dict(HEADERS))

    def __post_init__(self) -> None:
        for url in self.settings.route_urls:
            self.services[url] = RouteService(url)
        if self.settings.router.route_members:
            self.members = MembersView(ALIVE_INTERVALS * self.settings.worker.member_interval_s)

    @property
    def single(self) -> bool:
        """One route service, as before: no health gating, one attempt."""
        return self.members is None and len(self.services) == 1

    async def start(self, session: aiohttp.ClientSession) -> None:
        if self.members is not None:
            self._tasks.append(asyncio.create_task(follow_members(self.settings, self.members)))
        if not self.single:
            await self.check(session)
            self._tasks.append(asyncio.create_task(self._health(session)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ health

    async def _health(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.settings.router.route_health_interval_s)
            await self.check(session)

    async def check(self, session: aiohttp.ClientSession) -> None:
        """Health-check every known route service (and pick up discovered ones)."""
        self._discover()
        timeout = aiohttp.ClientTimeout(total=self.settings.router.route_health_interval_s)

        async def one(service: RouteService) -> None:
            try:
                async with session.get(f"{service.url}/healthz", timeout=timeout) as resp:
                    await resp.read()
                    ready = resp.status == 200
            except (aiohttp.ClientError, TimeoutError, OSError):
                ready = False
            if ready and not service.ready:
                service.skip_until = 0.0
            service.ready = ready

        await asyncio.gather(*(one(s) for s in list(self.services.values())))

    def _discover(self) -> None:
        if self.members is None:
            return
        prefix = f"{self.settings.worker.app_id}-route"
        found = {m.url for m in self.members.route_services(time.time(), prefix)}
        for url in found - set(self.services):
            self.services[url] = RouteService(url, static=False)
        for url in [u for u, s in self.services.items() if not s.static and u not in found]:
            del self.services[url]  # a discovered member that left

    # ------------------------------------------------------------------ requests

    def order(self, model: str, conversation_id: str | None) -> list[RouteService]:
        """The services to try for one request, best first (see the module)."""
        if self.single:
            return list(self.services.values())
        now = time.monotonic()
        usable = [s for s in self.services.values() if s.usable(now)]
        if not usable:
            return []
        if conversation_id:
            start = zlib.crc32(conversation_id.encode()) % len(usable)
        else:
            start = next(self._turn) % len(usable)
        ordered = usable[start:] + usable[:start]
        owner = self._owner(model)
        if owner is not None:
            ordered.sort(key=lambda s: s.url != owner)
        return ordered

    def _owner(self, model: str) -> str | None:
        if self.members is None:
            return None
        member = self.members.owner(model, self.settings.layout.partitions, time.time(),
                                    f"{self.settings.worker.app_id}-route")  # fmt: skip
        return member.url if member is not None else None

    @contextlib.asynccontextmanager
    async def post(
        self, session: aiohttp.ClientSession, data: bytes, model: str,
        conversation_id: str | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:  # fmt: skip
        """``POST /v1/route`` to the first service that answers within the route timeout
        (its response, to read inside the ``async with``); raises the last failure
        (``TimeoutError``, an ``aiohttp.ClientError``, :class:`NoRouteService`) when none
        answered, after which the router decides alone."""
        budget = self.settings.router.route_timeout_s
        deadline = time.monotonic() + budget
        candidates = self.order(model, conversation_id)
        if not candidates:
            raise NoRouteService("no route service is ready")
        failure: BaseException | None = None
        last: aiohttp.ClientResponse | None = None
        for n, service in enumerate(candidates):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if n:
                self.failovers += 1
            timeout = aiohttp.ClientTimeout(total=left / (len(candidates) - n))
            try:
                resp = await session.post(f"{service.url}/v1/route", data=data,
                                          headers=self.headers, timeout=timeout)  # fmt: skip
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                failure = exc
                self._failed(service)
                continue
            if resp.status >= 500 or resp.status == 421:
                self._failed(service)
                if last is not None:
                    last.release()
                last = resp
                continue
            service.answered += 1
            try:
                yield resp
            finally:
                resp.release()
                if last is not None:
                    last.release()
            return
        if last is not None:  # every one answered with a failure: the router reads the last
            try:
                yield last
            finally:
                last.release()
            return
        raise failure if failure is not None else TimeoutError("route timeout spent")

    def _failed(self, service: RouteService) -> None:
        service.failed += 1
        if not self.single:
            pause_s = self.settings.router.route_retry_after_failure_s
            service.skip_until = time.monotonic() + pause_s

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {"url": s.url, "ready": s.ready, "usable": s.usable(now), "answered": s.answered,
             "failed": s.failed, "discovered": not s.static}
            for s in self.services.values()
        ]  # fmt: skip
