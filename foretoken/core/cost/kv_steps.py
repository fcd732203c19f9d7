"""Prefill samples from the engine's own steps: consecutive KV batches of a busy worker.

A worker that is never idle gives no cold sample and few busy chains (a chain needs three
step budgets of prompts between first tokens, and any request sent after the previous
first token breaks it): on the quick matrix routed by a cache-aware policy, ``kimi-fast``
(`hetero`, a 16k-token budget) had three chains in 400 requests, the second of them
474 tokens in one 95 ms step, and predicted a 7k-token prompt 1.3 s against 0.15 s for
the rest of the run; ``kimi-ref-0`` on ``shared-system`` (8k-token shared prefix, 256 new
tokens a prompt) sat on the default curve for its first 34 requests, predicting 9–15 s
against 1–2 s.

Yet every step of an engine that prefills publishes its KV stores at the end of the
step, stamped with the engine's clock (vLLM's ``KVEventBatch.ts``; the simulator's
step end). While the queue model has prompts waiting or prefilling both when one such
batch arrives and when the next does, the engine stepped without pause in between and
every step carried a chunk: the time between the two stamps is one step, and the blocks
the later one stores are that step's prefill — ``u`` new tokens of a step that also ran
``decoding`` sequences. Each such step is a busy-chain sample of one step
(:class:`foretoken.core.cost.busy_fit.BusyChainFit`: ``a`` is the weighted median of
``(seconds − step − b·v) / u``, the step cost taken out the way the queue walk adds it).
Both stamps come from the engine's clock: no offset between hosts is in the sample.

``v = Σ(end² − start²)`` needs where in its prompt each stored run of blocks sits: a run
continues the chain at its parent block, so the depth of every block stored lately is kept
per worker, in two generations of ``MAX_BLOCKS_PER_WORKER`` (one C-level dict update per
run, the older generation dropped whole: 60–140 ns per block stored, where an LRU updated
block by block cost 640 ns, more than the index's own apply; ~100 bytes per block kept, so
up to ~1.6 MB per worker at the default, ``PredictorConfig.kv_step_blocks``). A
parent found in the older generation is copied forward, so a shared prefix stays. A run
whose parent is out of reach (stored before that, or before a restart) counts its tokens
in ``u`` with no ``v`` and the sample is not ``placed``. A placed sample is an exact one for the
busy fit: ``a`` and ``b`` are fitted together on such samples once they span prompt
positions (its ``_joint``), where ``b`` otherwise stays the reference deployment's — on
the ``demo`` fleet (a true ``b`` 5× the reference) ``a`` read 1.4× the truth with ``b``
fixed, and within 15% with it learned (``tests/unit/sim/test_busy_chain_convergence.py``).
Measured on the quick matrix (four gradings, docs/BENCHMARKS.md "Steps timed by their KV
batches"): with ``v`` from depths, +0.1 to +1.6 points within 1 s over ``v = 0``
(``mix-1k-200k/random-1/1.3``: 81.8% → 97.5%).

What can spoil a sample, and why the median copes: a lost batch (a gap in ``seq``: no
sample), a step whose chunk filled no whole block (the next sample spans two steps), a
stretch of decode-only steps while the queue model wrongly believes a prompt waits (an
outcome not arrived yet, or admission blocked by KV space) — each reads slow, and none
is the rule while prompts queue. Offload stores are not prefill, nor are other KV groups'
copies of the same tokens (only group 0 counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from foretoken.core.types import BlockStored, EngineBlockHash, KvBatch, WorkerId

# Blocks whose depth is kept per worker: the last 8,192 to 16,384 stored (module doc).
MAX_BLOCKS_PER_WORKER: Final = 8192
# A gap between two batches longer than this is not one step (an engine paused, a clock
# jump): no sample.
MAX_STEP_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step's prefill: ``u`` new tokens, ``v = Σ(end² − start²)`` over its
    runs of blocks, in ``seconds``."""

    u: float
    v: float
    seconds: float
    # every run's place in its prompt known (v whole): a sample the joint fit of a and b
    # may take (BusyChainFit's exact samples)
    placed: bool = True


@dataclass(slots=True)
class _Last:
    seq: int
    ts: float
    pending: bool


@dataclass(slots=True)
class _Places:
    """The depth (blocks from its prompt's start) of every block a worker stored lately, in
    two generations: blocks go into ``current`` (one C-level ``dict.update`` per run);
    when it holds ``limit`` blocks it becomes ``previous`` and the older one is dropped
    whole, so between ``limit`` and ``2·limit`` recent blocks are known. A parent found in
    ``previous`` is copied forward (a shared prefix stays)."""

    limit: int
    current: dict[EngineBlockHash, int] = field(default_factory=dict)
    previous: dict[EngineBlockHash, int] = field(default_factory=dict)

    def depth_of(self, parent: EngineBlockHash) -> int | None:
        depth = self.current.get(parent)
        if depth is None:
            depth = self.previous.get(parent)
            if depth is not None:
                self.current[parent] = depth
        return depth

    def add(self, hashes: tuple[EngineBlockHash, ...], first: int) -> None:
        """A run whose first block is at depth ``first + 1``."""
        depths = range(first + 1, first + 1 + len(hashes))
        self.current.update(zip(hashes, depths, strict=True))
        if len(self.current) >= self.limit:
            self.previous, self.current = self.current, {}


class KvSteps:
    """Step samples from consecutive KV batches (module doc)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_WORKER) -> None:
        self.max_blocks = max_blocks
        self._last: dict[WorkerId, _Last] = {}
        self._places: dict[WorkerId, _Places] = {}
        self.samples = 0

    def on_batch(self, batch: KvBatch, block_size: int, pending: bool) -> StepSample | None:
        """A worker's batch; ``pending``: whether its queue model has a prompt waiting or
        prefilling now. The step that ended with it, when it is a sample."""
        wid = batch.worker_id
        u, v, placed = self._stored(wid, batch, block_size)
        last = self._last.get(wid)
        self._last[wid] = _Last(batch.seq, batch.ts, pending)
        if not u or last is None or not (last.pending and pending):
            return None
        seconds = batch.ts - last.ts
        if batch.seq != last.seq + 1 or not 0.0 < seconds <= MAX_STEP_S:
            return None
        self.samples += 1
        return StepSample(float(u), float(v), seconds, placed)

    def forget(self, wid: WorkerId) -> None:
        """A worker gone or reset: its state goes."""
        self._last.pop(wid, None)
        self._places.pop(wid, None)

    def _stored(self, wid: WorkerId, batch: KvBatch, block_size: int) -> tuple[int, int, bool]:
        """The batch's new prompt tokens on the GPU (group 0), their ``v``, and whether
        every run's place was known."""
        u = v = 0
        placed = True
        places: _Places | None = None
        for e in batch.events:
            if not isinstance(e, BlockStored) or e.medium != "GPU" or e.group_idx != 0:
                continue
            hashes = e.block_hashes
            k = len(hashes)
            if not k:
                continue
            size = e.block_size or block_size
            u += k * size
            if places is None:
                places = self._places.get(wid)
                if places is None:
                    places = self._places[wid] = _Places(self.max_blocks)
            parent = e.parent_block_hash
            start = 0 if parent is None else places.depth_of(parent)
            if start is None:
                placed = False
                continue
            lo, hi = start * size, (start + k) * size
            v += hi * hi - lo * lo
            places.add(hashes, start)
        return u, v, placed
