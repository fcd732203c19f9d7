from __future__ import annotations

from foretoken.adapters.kafka.topics import topic_specs
from foretoken.settings import load_settings


def test_every_topic_is_declared_once_with_its_policy() -> None:
    s = load_settings(env={"FORETOKEN_TOPIC_PREFIX": "t-", "FORETOKEN_PARTITIONS": "3"})
    specs = {spec.logical: spec for spec in topic_specs(s)}
    assert set(specs) == {
        "workers",
        "kv_events",
        "grants",
        "outcomes",
        "graded",
        "dead_letter",
        "controls",
        "members",
    }
    assert specs["members"].compacted  # the latest record of every processor, kept
    assert specs["workers"].compacted and specs["workers"].config(1)["cleanup.policy"] == "compact"
    assert not specs["grants"].compacted
    assert specs["grants"].config(1000) == {"cleanup.policy": "delete", "retention.ms": "1000"}
    assert all(spec.partitions == 3 for spec in specs.values())
    assert specs["kv_events"].name == "t-kv-events"
