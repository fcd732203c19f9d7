"""The ``members`` topic: who runs where, as each processor advertises itself.

Every processor (primary or route replica) sends its :class:`~foretoken.wire.records.Member`
record — instance id, role, URL, consumer group, sharding, the partitions it consumes, its
readiness and the models its index holds — every ``worker.member_interval_s``, and a
``removed`` one on a clean stop. The topic is compacted and keyed by instance id, so a
reader that starts from the beginning sees the latest record of everyone; a record older
than :data:`ALIVE_INTERVALS` intervals is a member that died without saying so.

Readers (:func:`follow_members`: a consumer of no group, every partition from the start)
keep a :class:`MembersView`:

* route replicas take their **share** of near-ties from it (replica ``i`` of the ``n``
  alive, ready route replicas of the same topics, by instance id;
  :class:`~foretoken.core.routing.decide.ReplicaShare`);
* sharded route instances find the **owner** of a model (the ready instance whose
  partitions hold the model's partition) to forward a request to;
* routers discover route services (``router.route_members``) and ask a model's owner first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from foretoken.adapters.kafka.readiness import StartupError, wait_for_topics
from foretoken.core.routing.decide import ReplicaShare
from foretoken.settings import Settings
from foretoken.wire.codec import DecodeError, decode
from foretoken.wire.partitioning import model_partition
from foretoken.wire.records import Member

log = logging.getLogger(__name__)
ALIVE_INTERVALS = 3.0
RETRY_S = 1.0
# A member record stamped further ahead of the reader's clock than this is ignored.
MAX_AHEAD_S = 60.0


@dataclass
class MembersView:
    """The latest record of every member (pure: the follower feeds it)."""

    max_age_s: float
    members: dict[str, Member] = field(default_factory=dict)
    updates: int = 0

    def apply(self, member: Member, now_s: float | None = None) -> bool:
        """Take ``member`` unless an newer record of it is known, or (given the local clock
        ``now_s``) its time is more than :data:`MAX_AHEAD_S` ahead: such a record (a forged
        or broken clock) would otherwise outrank every true advert of that member forever."""
        if now_s is not None and member.ts > now_s + MAX_AHEAD_S:
            return False
        known = self.members.get(member.instance_id)
        if known is None or member.ts >= known.ts:
            self.members[member.instance_id] = member
            self.updates += 1
        return True

    def alive(self, now_s: float) -> list[Member]:
        """Members that said they run, recently enough, sorted by instance id."""
        return sorted(
            (m for m in self.members.values()
             if not m.removed and now_s - m.ts <= self.max_age_s),
            key=lambda m: m.instance_id,
        )  # fmt: skip

    def route_services(self, now_s: float, group_prefix: str | None = None) -> list[Member]:
        """Alive, ready route replicas (of one deployment: groups starting with the prefix)."""
        return [
            m for m in self.alive(now_s)
            if m.role == "route" and m.ready
            and (group_prefix is None or m.group.startswith(group_prefix))
        ]  # fmt: skip

    def share(self, me: str, group_prefix: str, now_s: float) -> ReplicaShare | None:
        """This replica's share among the ready, unsharded route replicas (None: alone,
        or not one of them yet)."""
        ids = [m.instance_id for m in self.route_services(now_s, group_prefix)
               if m.sharding == "none"]  # fmt: skip
        if me not in ids or len(ids) < 2:
            return None
        return ReplicaShare(ids.index(me), len(ids))

    def owner(self, model: str, partitions: int, now_s: float,
              group_prefix: str | None = None) -> Member | None:  # fmt: skip
        """The route instance sharded by model that owns ``model``'s partition: a ready one,
        else one still catching up (its answer beats none)."""
        wanted = model_partition(model, partitions)
        owners = [
            m for m in self.alive(now_s)
            if m.role == "route" and m.sharding == "model" and wanted in m.partitions
            and (group_prefix is None or m.group.startswith(group_prefix))
        ]  # fmt: skip
        owners.sort(key=lambda m: not m.ready)
        return owners[0] if owners else None


async def follow_members(
    settings: Settings, view: MembersView, on_update: Callable[[], None] | None = None
) -> None:
    """Read ``members`` from its start, forever, into ``view`` (a background task; it
    reconnects when the broker goes away)."""
    topic = settings.topic("members")
    while True:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka.bootstrap_servers, enable_auto_commit=False
        )
        try:
            found = await wait_for_topics(settings, ["members"], service="members")
            await consumer.start()
            tps = [TopicPartition(topic, p) for p in sorted(found[topic])]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while True:
                batches = await consumer.getmany(timeout_ms=500)
                for records in batches.values():
                    for record in records:
                        _apply(view, record.value)
                if batches and on_update is not None:
                    on_update()
        except (KafkaError, StartupError) as exc:
            log.warning("members: %s; reconnecting", exc)
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()
        await asyncio.sleep(RETRY_S)


def _apply(view: MembersView, value: bytes | None) -> None:
    try:
        member = decode(value, Member)
    except DecodeError as exc:
        log.warning("members: ignoring a record (%s)", exc.reason)
        return
    if not view.apply(member, time.time()):
        log.warning(
            "members: ignoring %r, stamped %.0f s ahead of this clock",
            member.instance_id[:64],
            member.ts - time.time(),
        )
