"""Prefill samples before the first token: a lone prompt's KV stores, step by step.

At a cold start every worker predicts on the default curve until a first token comes back,
and on a fleet that is fast beside that default the first requests are all misses: on the
held-out ``shared-system/random-5/1.0`` cell (seed 1), the 13 misses of 400 were the first
16 requests, all decided in the first 0.2 s, predicted 1.3–3.1 s against 0.1–0.7 s. Yet the
engine says how far a prefill has got long before its first token: a chunked prefill stores
its blocks step by step, and each KV batch (the engine's ``BlockStored`` events, published
at the end of the step that computed them) carries the engine's time.

So while a prompt sent to an idle worker (``WorkerBook.idle_start``) is the only request
outstanding there and has no first token yet, every GPU store in that worker's batches is
its own: the tokens it has computed are its credited prefix plus the stored blocks, and
the batch's ``ts`` less its send time is how long they took — a cold sample of a partial
prompt, ``C(computed) − C(cached)`` plus that many steps' overheads, fed as one-prompt
exact chains to a fit of their own (``WorkerFits.progress``) that answers only while the
cold and busy-chain fits are both still the default: one prompt's chunks grow its tokens
and its steps together, so its samples cannot tell ``a`` from the step overhead, and fed to
the busy chains they taught the queue walk an ``a`` 30% short for the rest of the run
(``poisson-long/random-5/1.3``, seed 1: 74.5% within 1 s, against 92.2% kept apart). It stops at the
prompt's last whole block (its first token follows; the cold sample takes it from there),
at a second request sent there, or at the first token.

Only full blocks are stored, so up to a block of the prompt's progress is unseen (a sample
reads at most ``block_size`` tokens short). Stores of a lower tier (offload copies) are
not progress. The engine's clock stamps the batch and the route service's the send: on one
host the same clock; across hosts their offset (NTP: milliseconds) is in the sample.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.types import BlockStored, KvBatch, RequestId, WorkerId, WorkerProfile

# Prompts whose progress is followed at once (one per idle worker; a bound, not a tuning).
MAX_FOLLOWED: Final = 4096


@dataclass(frozen=True, slots=True)
class Progress:
    """``computed`` tokens of a prompt (``cached`` of them reused) done ``seconds`` after it
    was sent to its idle worker."""

    profile: WorkerProfile
    computed: int
    cached: int
    seconds: float


class PrefillProgress:
    """Partial cold samples from a lone prompt's KV stores (module doc)."""

    def __init__(self, book: WorkerBook) -> None:
        self.book = book
        # per prompt followed: (its worker, tokens known computed); None once done
        self._computed: OrderedDict[RequestId, tuple[WorkerId, int] | None] = OrderedDict()
        self.samples = 0

    def on_batch(self, batch: KvBatch) -> Progress | None:
        """A worker's KV batch: the prompt's progress when it is a sample (module doc)."""
        wid = batch.worker_id
        stored = sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored)
                     and e.medium == "GPU" and e.group_idx == 0)  # fmt: skip
        start = self.book.idle_start.get(wid)
        profile, queue = self.book.profiles.get(wid), self.book.queues.get(wid)
        if not stored or start is None or profile is None or queue is None:
            return None
        rid, sent_s = start
        entry = queue.get(rid)
        if entry is None or entry.first_token_s is not None or queue.outstanding_count != 1:
            self._stop(rid)
            return None
        known = self._computed.get(rid, (wid, entry.cached_tokens))
        if known is None or known[0] != wid:
            return None
        whole = entry.prompt_tokens // profile.block_size * profile.block_size
        computed = known[1] + stored * profile.block_size
        if computed >= whole:  # its last whole block: the first token's sample follows
            self._stop(rid)
            return None
        self._computed[rid] = (wid, computed)
        while len(self._computed) > MAX_FOLLOWED:
            self._computed.popitem(last=False)
        seconds = batch.ts - sent_s
        if not seconds > 0 or computed <= entry.cached_tokens:
            return None
        self.samples += 1
        return Progress(profile, computed, entry.cached_tokens, seconds)

    def _stop(self, rid: RequestId) -> None:
        if rid in self._computed:
            self._computed[rid] = None
