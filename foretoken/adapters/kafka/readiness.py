"""Start-up that cannot race: wait, with a deadline, until a service's topics exist and every
one of their partitions has a leader the cluster metadata knows.

A freshly created topic exists for the controller before its partitions' leaders reach the
metadata a client sees; a consumer that asks at once may find no partitions at all (and
committing an empty offset map raises ``ValueError: {}`` in aiokafka). So every service
that reads or writes foretoken topics first calls :func:`wait_for_topics`, which:

* retries the broker connection until the deadline (a broker still starting up);
* lists the topics without ever creating one (a metadata request for a missing topic would
  auto-create it with the broker's default layout, so topics are only listed, then
  described by name once they exist);
* waits until each topic has the partitions it should have, each with a leader;
* fails with :class:`StartupError` naming what it waited for: the missing topics (and the
  command that creates them) or the partitions still without a leader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError

from foretoken.settings import Settings

log = logging.getLogger(__name__)
POLL_S = 0.25


class StartupError(RuntimeError):
    """A service could not start: what it waited for, and what to do about it
    (``topics``: the topics that were missing or had no leader yet, if that was it)."""

    def __init__(self, message: str, topics: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.topics = list(topics)


@dataclass(frozen=True, slots=True)
class TopicState:
    """What the cluster metadata says of one topic: partition → leader (-1: none yet)."""

    name: str
    leaders: dict[int, int]

    @property
    def ready(self) -> bool:
        """Partitions known and each with a leader (a topic's partitions reach the metadata
        together; their leaders may follow a moment later)."""
        return bool(self.leaders) and all(leader >= 0 for leader in self.leaders.values())


async def _connect(settings: Settings, deadline: float) -> AIOKafkaAdminClient:
    loop = asyncio.get_running_loop()
    bootstrap = settings.kafka.bootstrap_servers
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        try:
            await admin.start()
            return admin
        except (KafkaConnectionError, KafkaError, OSError) as exc:
            await admin.close()
            if loop.time() > deadline:
                raise StartupError(
                    f"no Kafka broker answered on {bootstrap} ({exc}); start one with "
                    "`foretoken kafka up` or set KAFKA_BOOTSTRAP_SERVERS"
                ) from exc
            await asyncio.sleep(POLL_S)


async def _states(admin: AIOKafkaAdminClient, names: Sequence[str]) -> dict[str, TopicState]:
    existing = set(await admin.list_topics())
    present = [n for n in names if n in existing]
    if not present:
        return {}
    out: dict[str, TopicState] = {}
    for topic in await admin.describe_topics(present):
        if topic.get("error_code", 0):
            continue
        leaders = {int(p["partition"]): int(p["leader"]) for p in topic.get("partitions", [])}
        out[str(topic["topic"])] = TopicState(str(topic["topic"]), leaders)
    return out


async def wait_for_topics(
    settings: Settings,
    logicals: Sequence[str],
    *,
    service: str,
    timeout_s: float | None = None,
) -> dict[str, set[int]]:
    """Wait until the topics (logical names: ``kv_events`` …) exist and every partition
    has a leader; returns full topic name → its partitions. Raises :class:`StartupError`
    at the deadline (``settings.kafka.startup_timeout_s`` by default)."""
    loop = asyncio.get_running_loop()
    timeout = settings.kafka.startup_timeout_s if timeout_s is None else timeout_s
    deadline = loop.time() + timeout
    names = [settings.topic(logical) for logical in logicals]
    admin = await _connect(settings, deadline)
    announced = False
    try:
        while True:
            try:
                states = await _states(admin, names)
            except KafkaError as exc:  # a broker still electing its controller
                log.info("%s: metadata not available yet (%s)", service, exc)
                states = {}
            missing = [n for n in names if n not in states]
            unready = [n for n in names if n in states and not states[n].ready]
            if not missing and not unready:
                return {n: set(states[n].leaders) for n in names}
            if loop.time() > deadline:
                message = _explain(service, timeout, missing, unready, states)
                raise StartupError(message, missing + unready)
            if not announced:
                log.warning("%s: waiting up to %.0f s for topics %s", service, timeout,
                            ", ".join(missing + unready))  # fmt: skip
                announced = True
            await asyncio.sleep(POLL_S)
    finally:
        await admin.close()


def _explain(
    service: str,
    timeout_s: float,
    missing: list[str],
    unready: list[str],
    states: dict[str, TopicState],
) -> str:
    parts = [f"{service} waited {timeout_s:.0f} s for its topics and gave up:"]
    if missing:
        parts.append(
            f"topic(s) {', '.join(missing)} do not exist; create them with "
            "`foretoken topics create` (same settings: topic prefix, partitions)"
        )
    for name in unready:
        leaders = states[name].leaders
        lacking = sorted(p for p, leader in leaders.items() if leader < 0)
        parts.append(
            f"topic {name}: {len(leaders)} partition(s) known"
            + (f", no leader yet for {lacking}" if lacking else "")
        )
    return " ".join(parts)
