"""Approximate cache mode for engines that publish no KV events (issue 9, pure).

llama.cpp, TGI and vLLM deployments without ``--kv-events-config`` tell foretoken nothing
about their prefix cache. For such a worker (``WorkerProfile.has_kv_events = False``)
the index is fed by the route service's own decisions instead, as Dynamo's and SGLang's
routers do without events:

* **Store.** A prompt's blocks are taken as cached on the worker that served it once its
  first token arrived (the prefill is done then), in the GPU tier
  (:meth:`foretoken.core.index.prefix.PrefixIndex.observe_served`). Blocks the worker already holds
  are refreshed, not duplicated. Only the prompt is recorded: the output's token ids never
  reach the route service.
* **Age.** Every block is forgotten ``ttl_s`` after the last prompt that used it was
  served (swept ``SWEEPS_PER_TTL`` times per TTL, so a block lives at most TTL·(1+1/8)).
* **Capacity.** At most the worker's estimated capacity in blocks is kept: ``gpu_blocks``
  from its registration when the engine tells, else ``default_capacity_tokens`` /
  block size. Beyond it, the least recently served blocks go first, and within one prompt
  its last blocks before its first (engines free a sequence's tail first; a prefix stays
  matchable longest).
* **Flags.** Every hit on such a worker is ``approximate`` and its credit's source is
  ``"approximate"`` (``CandidatePrediction.cache_source``, on grants, graded records, the
  lake and ``/v1/cache/{model}``).
"""

from __future__ import annotations

from dataclasses import dataclass

from foretoken.core.types import WorkerProfile


@dataclass(frozen=True, slots=True)
class ApproxCacheConfig:
    """How long and how much the approximate view keeps per worker (settings: worker)."""

    ttl_s: float = 300.0
    default_capacity_tokens: int = 65_536

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"approximate cache ttl_s must be > 0, got {self.ttl_s}")
        if self.default_capacity_tokens < 1:
            raise ValueError("approximate cache default_capacity_tokens must be >= 1")

    def capacity_blocks(self, reg: WorkerProfile) -> int:
        """The worker's estimated cache capacity in blocks (its own figure when it has one)."""
        if reg.gpu_blocks is not None:
            return reg.gpu_blocks
        return max(1, self.default_capacity_tokens // reg.block_size)


def index_params(reg: WorkerProfile, config: ApproxCacheConfig) -> tuple[float | None, int | None]:
    """``(store_only_ttl_s, capacity_blocks)`` for ``PrefixIndex.register_worker``: aged and
    capped for a worker without events, neither for one that publishes them."""
    if reg.has_kv_events:
        return None, None
    return config.ttl_s, config.capacity_blocks(reg)
