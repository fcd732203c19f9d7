"""What a processor does when Kafka assigns it partitions — a route replica's start and every
rebalance (docs/ARCHITECTURE.md "Scale-out").

The primary is rewound before Faust starts (:mod:`foretoken.adapters.kafka.offsets`): it is the
only member of its group. Route instances sharded by model share one group, so a newcomer
cannot rewind offsets the others hold; instead every route instance, on every assignment and
before Faust seeks its partitions to their committed offsets, *commits as a member* where
each of its partitions must start, from state it loads at that moment:

* ``workers``: the start of the log (compacted: every registration);
* ``kv-events``: the latest primary snapshot (``worker.snapshot_dir``) is loaded, its index
  taken (sharded: only the workers of the models this instance owns), and each partition
  starts after the snapshot's offset (batches at or below it are skipped anyway);
* ``grants`` and ``outcomes``: the offsets of ``now − worker.catch_up_horizon_s`` (Kafka's
  offsets for times), so the requests still in flight are in the queue models again (queue
  models take grants idempotently, remember finished requests and outcomes that overtake
  their grant, so a replay is harmless);
* ``graded`` (read-only, for cold samples): from the later of that horizon and the fits
  snapshot's time.

The same rules as a restart of the primary (index from a snapshot + offsets, registrations
from the start), reused: :class:`~foretoken.adapters.kafka.index_keeper.IndexKeeper`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from foretoken.adapters.kafka.fits_file import fits_path
from foretoken.adapters.kafka.index_keeper import IndexKeeper, snapshot_path
from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.wire.partitioning import model_partition

log = logging.getLogger(__name__)


class Rebalancer:
    """The assignment hook of a processor's Faust app (``state.role`` decides what it does)."""

    def __init__(self, state: ProcessorState) -> None:
        self.state = state
        self.settings = state.settings
        self.rebalances = 0
        self.last_starts: dict[str, dict[int, int]] = {}

    async def on_assigned(self, consumer: Any, assigned: set[Any]) -> None:
        state = self.state
        tps = {(tp.topic, tp.partition) for tp in assigned}
        if state.role == "primary":
            state.lag.assign(tps)
            return
        self.rebalances += 1
        kv = self.settings.topic("kv_events")
        state.owned = {p for t, p in tps if t == kv}
        loop = asyncio.get_running_loop()
        path = snapshot_path(self.settings)
        keeper = await loop.run_in_executor(None, IndexKeeper.load, kv, path, self.settings.index)
        dropped = adopt(state, keeper)
        starts = await self._starts(assigned, keeper)
        committed = await consumer._commit(starts)  # as a member: for the group's next reader
        # and seek there now: Faust may already be positioned at the offsets committed in a
        # previous life (a restart would then never re-read the registrations)
        for tp, off in starts.items():
            await consumer.seek(tp, off)
        state.lag.assign(tps, {(tp.topic, tp.partition): off for tp, off in starts.items()})
        self.last_starts = {}
        for tp, off in starts.items():
            self.last_starts.setdefault(tp.topic, {})[tp.partition] = off
        log.warning(
            "route replica %s: partitions %s, snapshot offsets %s, %d workers of other "
            "models left out, start offsets committed: %s", self.settings.instance_id,
            sorted(state.owned), keeper.restored_from, dropped, committed,
        )  # fmt: skip

    async def _starts(self, assigned: set[Any], keeper: IndexKeeper) -> dict[Any, int]:
        consumer = AIOKafkaConsumer(  # of no group: offsets for times, begins, ends
            bootstrap_servers=self.settings.kafka.bootstrap_servers, enable_auto_commit=False
        )
        await consumer.start()
        try:
            return await self._offsets(consumer, assigned, keeper)
        finally:
            await consumer.stop()

    async def _offsets(
        self, consumer: AIOKafkaConsumer, assigned: set[Any], keeper: IndexKeeper
    ) -> dict[Any, int]:
        s = self.settings
        plain = {tp: TopicPartition(tp.topic, tp.partition) for tp in assigned}
        begins = await consumer.beginning_offsets(list(plain.values()))
        ends = await consumer.end_offsets(list(plain.values()))
        horizon_s = time.time() - s.worker.catch_up_horizon_s
        fits = fits_path(s)
        graded_s = max(horizon_s, fits.stat().st_mtime) if fits.exists() else horizon_s
        since = {s.topic("grants"): horizon_s, s.topic("outcomes"): horizon_s,
                 s.topic("graded"): graded_s}  # fmt: skip
        wanted = {p: int(since[p.topic] * 1000) for p in plain.values() if p.topic in since}
        found = await consumer.offsets_for_times(wanted) if wanted else {}
        starts: dict[Any, int] = {}
        for tp, p in plain.items():
            first = begins[p]
            if tp.topic == s.topic("kv_events"):
                applied = keeper.applied.get(tp.partition)
                starts[tp] = first if applied is None else max(applied + 1, first)
            elif p in found:
                hit = found[p]
                starts[tp] = hit.offset if hit is not None else ends[p]
            else:  # workers (compacted): every registration
                starts[tp] = first
        return starts


def adopt(state: ProcessorState, keeper: IndexKeeper) -> int:
    """``state`` reads ``keeper``'s index (a snapshot just loaded) from now on; sharded,
    the workers of models it does not own leave the index and the route service's book.
    Returns how many workers were left out."""
    partitions = state.settings.layout.partitions
    dropped = 0
    if state.sharded:
        workers = keeper.index.stats()["workers"]
        for wid, info in list(workers.items()):  # type: ignore[attr-defined]
            if model_partition(str(info["model"]), partitions) not in state.owned:
                keeper.index.remove_worker(wid)
                keeper.known.discard(wid)
                dropped += 1
        for wid, profile in list(state.core.service.book.profiles.items()):
            if model_partition(profile.model, partitions) not in state.owned:
                state.core.forget_worker(wid)
                state.registrations.pop(wid, None)
                state.index.registrations.pop(wid, None)
    state.index.adopt(keeper)
    state.core.use_index(state.index.index)
    return dropped
