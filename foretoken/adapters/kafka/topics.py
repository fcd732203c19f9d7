"""Every topic of PRODUCT.md §2 declared once, and the admin step that creates them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from foretoken.adapters.kafka.readiness import StartupError
from foretoken.settings import Settings

TOPIC_EXISTS_ERROR_CODE = TopicAlreadyExistsError.errno
ADMIN_RETRY_S = 0.5


@dataclass(frozen=True, slots=True)
class TopicSpec:
    logical: str
    name: str
    partitions: int
    compacted: bool

    def config(self, retention_ms: int) -> dict[str, str]:
        if self.compacted:
            return {"cleanup.policy": "compact"}
        return {"cleanup.policy": "delete", "retention.ms": str(retention_ms)}


def topic_specs(settings: Settings) -> list[TopicSpec]:
    layout = settings.layout
    return [
        TopicSpec(
            logical=logical,
            name=name,
            partitions=layout.partitions,
            compacted=logical in layout.compacted,
        )
        for logical, name in settings.all_topics().items()
    ]


async def ensure_topics(settings: Settings, timeout_s: float = 60.0) -> list[str]:
    """Create the topics that do not exist yet; returns the names created now."""
    specs = topic_specs(settings)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap_servers)
        try:
            await admin.start()
            break
        except KafkaConnectionError as exc:
            await admin.close()
            if asyncio.get_running_loop().time() > deadline:
                raise StartupError(
                    f"no Kafka broker answered on {settings.kafka.bootstrap_servers} within "
                    f"{timeout_s:.0f} s ({exc}); start one with `foretoken kafka up`"
                ) from exc
            await asyncio.sleep(ADMIN_RETRY_S)
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(
                name=s.name,
                num_partitions=s.partitions,
                replication_factor=settings.layout.replication_factor,
                topic_configs=s.config(settings.layout.retention_ms),
            )
            for s in specs
            if s.name not in existing
        ]
        if not new:
            return []
        response = await admin.create_topics(new)
        created = []
        # create_topics reports per-topic errors in the response, not as exceptions.
        for name, code, message in _topic_errors(response):
            if code == 0:
                created.append(name)
            elif code != TOPIC_EXISTS_ERROR_CODE:
                raise RuntimeError(f"creating topic {name} failed: error {code} {message}")
        return created
    finally:
        await admin.close()


def _topic_errors(response: object) -> list[tuple[str, int, str | None]]:
    out: list[tuple[str, int, str | None]] = []
    for entry in getattr(response, "topic_errors", []):
        name, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else None
        out.append((name, code, message))
    return out
