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
step end). When a request sent before one such batch had its first token only after the
next one, it waited or prefilled there all along, and the engine (which does not idle
with a prompt to run) stepped without pause in between: the time between the two stamps
is one step, and the blocks the later one stores are that step's prefill — ``u`` new
tokens of a step that also ran ``decoding`` sequences. Each such step is a busy-chain
sample of one step (:class:`foretoken.core.cost.busy_fit.BusyChainFit`: ``a`` is the
weighted median of ``(seconds − step − b·v) / u``, the step cost taken out the way the
queue walk adds it). Both stamps come from the engine's clock: no offset between hosts is
in the step's time.

Which request waited through the step: one the queue model still has without a first
token when the later batch comes, sent before the earlier one — if the router acted on its
decision (its grant came back) and it is not older than ``MAX_HOLD_S`` (an outcome lost);
the step is a sample at once. Else the step is held until a first token witnesses it (the
last ``WITNESSES`` first tokens are kept for batches that come after theirs), and one no
first token witnesses within ``MAX_HOLD_S`` goes. The queue model's word alone is not
enough: a decision nobody acted on (a caller that only asked ``/v1/route``) stays in it
for ``unconfirmed_decision_s``; with 90 of them there, the gaps between sequential
requests on an idle worker read as steps of 80 tokens taking 0.1 s, and the controls
turned every later request away (``tests/integration/test_edges_stack.py``, which
failed in CI). Waiting for a witness every time cost 0.15–0.75 points (cell mean within
1 s) on the four gradings (a 200k-token prompt's chunk steps fed the fit only at its first
token); taking the acted-on requests' word first: −0.01 to +0.3 against the queue model's
word alone.

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
stretch of decode-only steps while a witness waits (admission blocked by KV space), a
request that reached the engine a little after the batch before its step (network delay,
or the engine's clock ahead of the router's) — each reads slow, and none is the rule.
Offload stores are not prefill, nor are other KV groups' copies of the same tokens (only
group 0 counts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from foretoken.core.types import BlockStored, EngineBlockHash, KvBatch, WorkerId

# Blocks whose depth is kept per worker: the last 8,192 to 16,384 stored (module doc).
MAX_BLOCKS_PER_WORKER: Final = 8192
# A gap between two batches longer than this is not one step (an engine paused, a clock
# jump): no sample.
MAX_STEP_S: Final = 30.0
# A step no first token has witnessed this long after it ended (engine clock, against the
# worker's newest batch) was not one: it goes. So do the oldest beyond MAX_HELD.
MAX_HOLD_S: Final = 120.0
MAX_HELD: Final = 512
# First tokens kept per worker to witness steps whose batch arrives after them.
WITNESSES: Final = 32


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step's prefill: ``u`` new tokens, ``v = Σ(end² − start²)`` over its
    runs of blocks, in ``seconds`` (from the batch stamped ``start_ts`` to the one stamped
    ``end_ts``), beside ``decoding`` sequences."""

    u: float
    v: float
    seconds: float
    # every run's place in its prompt known (v whole): a sample the joint fit of a and b
    # may take (BusyChainFit's exact samples)
    placed: bool = True
    decoding: float = 0.0
    start_ts: float = 0.0
    end_ts: float = 0.0


@dataclass(slots=True)
class _Last:
    seq: int
    ts: float


@dataclass(slots=True)
class _Held:
    """A worker's samples waiting for a witness, and its latest witnesses."""

    samples: deque[StepSample] = field(default_factory=deque)
    witnesses: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WITNESSES))

    def witnessed(self, sample: StepSample) -> bool:
        return any(s <= sample.start_ts and sample.end_ts <= f for s, f in self.witnesses)


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
    """Step samples from consecutive KV batches, each given out once a first token
    witnesses it (module doc)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_WORKER) -> None:
        self.max_blocks = max_blocks
        self._last: dict[WorkerId, _Last] = {}
        self._places: dict[WorkerId, _Places] = {}
        self._held: dict[WorkerId, _Held] = {}
        self.samples = 0  # witnessed (given out)
        self.unwitnessed = 0  # dropped with no witness: an idle gap, or a witness lost

    def on_batch(
        self, batch: KvBatch, block_size: int, decoding: float,
        waiting_since: Callable[[], float | None] = lambda: None,
    ) -> list[StepSample]:  # fmt: skip
        """A worker's batch, while ``decoding`` sequences run there and a request the
        router sent at ``waiting_since()`` still waits for its first token (its queue
        model; asked only when the batch ends a step): the step that ended with it, if that
        request was sent before the step began or a first token witnessed the step already
        (else it is held for one)."""
        wid = batch.worker_id
        u, v, placed = self._stored(wid, batch, block_size)
        last = self._last.get(wid)
        self._last[wid] = _Last(batch.seq, batch.ts)
        if not u or last is None:
            return []
        seconds = batch.ts - last.ts
        if batch.seq != last.seq + 1 or not 0.0 < seconds <= MAX_STEP_S:
            return []
        sample = StepSample(float(u), float(v), seconds, placed, decoding, last.ts, batch.ts)
        held = self._held_of(wid)
        since = waiting_since()
        if (since is not None and since <= last.ts) or held.witnessed(sample):
            self.samples += 1
            return [sample]
        samples = held.samples
        samples.append(sample)
        while samples and (len(samples) > MAX_HELD or samples[0].end_ts < batch.ts - MAX_HOLD_S):
            samples.popleft()
            self.unwitnessed += 1
        return []

    def on_first_token(self, wid: WorkerId, sent_s: float, first_s: float) -> list[StepSample]:
        """A request sent to ``wid`` at ``sent_s`` had its first token at ``first_s``: it
        waited or prefilled there all along, so every step between two batches within that
        span was one the engine ran without pause. Those held are given out."""
        held = self._held_of(wid)
        held.witnesses.append((sent_s, first_s))
        out: list[StepSample] = []
        kept: deque[StepSample] = deque()
        for x in held.samples:
            (out if sent_s <= x.start_ts and x.end_ts <= first_s else kept).append(x)
        if out:
            held.samples = kept
            self.samples += len(out)
        return out

    def _held_of(self, wid: WorkerId) -> _Held:
        held = self._held.get(wid)
        if held is None:
            held = self._held[wid] = _Held()
        return held

    def forget(self, wid: WorkerId) -> None:
        """A worker gone or reset: its state goes."""
        self._last.pop(wid, None)
        self._places.pop(wid, None)
        self._held.pop(wid, None)

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
