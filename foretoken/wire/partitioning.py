"""Where a record goes on its topic when the topics are sharded by model
(``sharding = "model"``; docs/ARCHITECTURE.md "Scale-out").

The key stays what it is (the worker id for ``workers`` and ``kv-events``, the request id for
``grants``, ``outcomes`` and ``graded``), so compaction and the readers' dedupe are
unchanged; only the partition is chosen from the model, by a hash every producer and every
reader computes alike (CRC-32 of the model's UTF-8 name: stable across processes, Python
versions and hosts, unlike ``hash()``). With the topics co-partitioned (same partition
count), one partition number holds everything about a model, and the processor that owns it
owns the model.
"""

from __future__ import annotations

import zlib
from typing import Final

# The topics whose records are placed by model when sharded.
SHARDED_TOPICS: Final = ("workers", "kv_events", "grants", "outcomes", "graded")


def model_partition(model: str, partitions: int) -> int:
    """The partition of everything about ``model`` on a topic of ``partitions``."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return zlib.crc32(model.encode()) % partitions
