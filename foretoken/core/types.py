"""Typed identities shared by every package (house rule 4)."""

from __future__ import annotations

from typing import NewType

WorkerId = NewType("WorkerId", str)
RequestId = NewType("RequestId", str)
ModelName = NewType("ModelName", str)
ConversationId = NewType("ConversationId", str)
WorkloadClass = NewType("WorkloadClass", str)
# An engine's own block hash, normalized to an unsigned 64-bit int (opaque, per engine).
EngineBlockHash = NewType("EngineBlockHash", int)
# foretoken's own chained content hash of a block (unsigned 64-bit).
ContentHash = NewType("ContentHash", int)
