"""Start-up errors say what was waited for (streams/readiness.py, streams/offsets.py)."""

from __future__ import annotations

import asyncio

import pytest

from foretoken.adapters.kafka.offsets import rewind_group
from foretoken.adapters.kafka.readiness import StartupError, TopicState, _explain, wait_for_topics
from foretoken.settings import load_settings


def test_an_empty_partition_set_is_never_committed() -> None:
    """The demo's crash was ``consumer.commit({})``; an empty set is refused before that."""
    settings = load_settings(env={})
    with pytest.raises(StartupError, match="no partitions known for kv-events"):
        asyncio.run(rewind_group(settings, "g", "kv-events", set(), None))


def test_topic_state_is_ready_only_with_every_leader() -> None:
    assert not TopicState("t", {}).ready
    assert not TopicState("t", {0: 1, 1: -1}).ready
    assert TopicState("t", {0: 1, 1: 1}).ready


def test_the_explanation_names_missing_topics_and_the_command() -> None:
    states = {"p-grants": TopicState("p-grants", {0: 1, 1: -1})}
    text = _explain("the worker", 60.0, ["p-kv-events"], ["p-grants"], states)
    assert "the worker waited 60 s" in text
    assert "p-kv-events" in text and "foretoken topics create" in text
    assert "topic p-grants: 2 partition(s) known, no leader yet for [1]" in text


def test_no_broker_is_an_error_that_says_how_to_start_one() -> None:
    settings = load_settings(env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    with pytest.raises(StartupError, match="foretoken kafka up") as info:
        asyncio.run(wait_for_topics(settings, ("workers",), service="x", timeout_s=0.5))
    assert "127.0.0.1:1" in str(info.value)
