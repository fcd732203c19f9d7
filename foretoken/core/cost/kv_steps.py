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
continues the chain at its parent block, so the depth of every recently stored block is
kept per worker (a bounded LRU, ``MAX_DEPTHS_PER_WORKER`` blocks — about 0.8 MB per worker
at most; a parent found there is touched, so a shared prefix stays). A run whose parent
is unknown (stored before the map's reach, or after a restart) counts its tokens in ``u``
with no ``v`` and the sample is not ``placed``. A placed sample is an exact one for the
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

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from foretoken.core.types import BlockStored, EngineBlockHash, KvBatch, WorkerId

# Block depths (blocks from the prompt start) remembered per worker, least recently used dropped.
MAX_DEPTHS_PER_WORKER: Final = 8192
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


class KvSteps:
    """Step samples from consecutive KV batches (module doc)."""

    def __init__(self, max_depths: int = MAX_DEPTHS_PER_WORKER) -> None:
        self.max_depths = max_depths
        self._last: dict[WorkerId, _Last] = {}
        self._depths: dict[WorkerId, OrderedDict[EngineBlockHash, int]] = {}
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
        self._depths.pop(wid, None)

    def _stored(self, wid: WorkerId, batch: KvBatch, block_size: int) -> tuple[int, int, bool]:
        """The batch's new prompt tokens on the GPU (group 0), their ``v``, and whether
        every run's place was known."""
        u = v = 0
        placed = True
        depths: OrderedDict[EngineBlockHash, int] | None = None
        for e in batch.events:
            if not isinstance(e, BlockStored) or e.medium != "GPU" or e.group_idx != 0:
                continue
            k = len(e.block_hashes)
            if not k:
                continue
            size = e.block_size or block_size
            u += k * size
            if depths is None:
                depths = self._depths.setdefault(wid, OrderedDict())
            parent = e.parent_block_hash
            start = 0 if parent is None else depths.get(parent)
            if start is None:
                placed = False
                continue
            if parent is not None:
                depths.move_to_end(parent)
            lo, hi = start * size, (start + k) * size
            v += hi * hi - lo * lo
            for depth, block in enumerate(e.block_hashes, start + 1):
                depths[block] = depth
            while len(depths) > self.max_depths:
                depths.popitem(last=False)
        return u, v, placed
