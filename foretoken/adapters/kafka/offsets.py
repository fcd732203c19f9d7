"""Setting a consumer group's committed offsets before the Faust worker starts.

In-memory state (the cache index) is rebuilt on start from a snapshot plus a replay of the
topic from the snapshot's offsets: committing those offsets for the group, while no member
is running, makes the Faust agent itself do the replay. Records the snapshot already holds
are then skipped by offset in the handler, so a replay never applies anything twice.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from foretoken.adapters.kafka.readiness import StartupError
from foretoken.settings import Settings

log = logging.getLogger(__name__)
RETRY_S = 1.0


async def rewind_group(
    settings: Settings,
    group_id: str,
    topic: str,
    partitions: set[int],
    next_offsets: dict[int, int] | None,
) -> dict[int, int]:
    """Commit ``next_offsets`` (partition → next offset to read; missing partitions → 0, the
    start of the topic) for ``group_id`` on ``topic``'s ``partitions`` (as
    :func:`foretoken.adapters.kafka.readiness.wait_for_topics` found them: never empty). Returns
    what was
    committed.

    After a hard kill the dead member stays in the group until its session times out, and
    the broker refuses the commit until then: retry for up to twice the session timeout."""
    if not partitions:
        raise StartupError(f"no partitions known for {topic}: nothing to rewind")
    deadline = asyncio.get_running_loop().time() + 2 * settings.worker.session_timeout_s
    while True:
        try:
            return await _commit(settings, group_id, topic, partitions, next_offsets)
        except KafkaError as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise StartupError(
                    f"could not set the offsets of group {group_id} on {topic} within "
                    f"{2 * settings.worker.session_timeout_s:.0f} s: {exc}"
                ) from exc
            log.warning("group %s busy (%s): retrying the rewind", group_id, exc)
            await asyncio.sleep(RETRY_S)


async def _commit(
    settings: Settings,
    group_id: str,
    topic: str,
    partitions: set[int],
    next_offsets: dict[int, int] | None,
) -> dict[int, int]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        group_id=group_id,
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        beginning = await consumer.beginning_offsets(tps)
        wanted = {tp: max((next_offsets or {}).get(tp.partition, 0), beginning[tp]) for tp in tps}
        await consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in wanted.items()})
        return {tp.partition: off for tp, off in wanted.items()}
    finally:
        await consumer.stop()
