"""A cached prefix the queue ahead will evict before the request starts is not credited
(``PredictorConfig.evict_under_pressure``): on a worker whose KV pool is small beside the
prefill still queued there, the index's credit is dropped — except the depth a prompt still
held there shares (its blocks are pinned or freshest), which stays."""

from __future__ import annotations

import numpy as np
import pytest

from foretoken.core.index.native import NativeIndex
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.core.types import CacheSource
from foretoken.wire.records import (
    BlockStored,
    KvEventBatch,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest

BLOCK = 16
MODEL = "m"
CACHED = list(range(1, 513))  # 32 blocks the engine reported stored


def _service(native: bool, gpu_blocks: int, tiers: tuple[str, ...] = ("GPU",),
             **cfg: object) -> RouteService:  # fmt: skip
    index = NativeIndex() if native else PrefixIndex()
    config = PredictorConfig(**{"explore_fraction": 0.0, **cfg})  # type: ignore[arg-type]
    service = RouteService(index, config=config)
    reg = WorkerRegistration(
        worker_id="w0", model=MODEL, engine="vllm", engine_version="x", block_size=BLOCK,
        scheduler=SchedulerSettings(max_num_batched_tokens=512, max_num_seqs=4),
        endpoints=WorkerEndpoints(http_url="http://w0"), config_hash="c", ts=0.0,
        gpu_blocks=gpu_blocks, tiers=tiers,  # type: ignore[arg-type]
    )  # fmt: skip
    index.register_worker(reg.worker_id, reg.model, reg.block_size)
    service.on_registration(reg)
    hashes = tuple(range(1, len(CACHED) // BLOCK + 1))
    stored = BlockStored(block_hashes=hashes, token_ids=tuple(CACHED), block_size=BLOCK)  # type: ignore[arg-type]
    index.apply(KvEventBatch(worker_id=reg.worker_id, model=reg.model, seq=0, ts=0.0,
                             events=(stored,)), 0.0)  # fmt: skip
    return service


def _req(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(request_id=rid, model=MODEL, token_ids=tuple(tokens))


def _filler(i: int) -> list[int]:
    rng = np.random.default_rng(i)
    return rng.integers(100_000, 200_000, 1500).tolist()  # shares nothing


@pytest.mark.parametrize("native", [True, False])
def test_the_credit_stands_on_an_idle_worker_and_falls_under_a_deep_queue(native: bool) -> None:
    prompt = CACHED + [7] * 200
    idle = _service(native, gpu_blocks=256)
    assert idle.route(_req("a", prompt).query(), 0.0, 0.0).cached_tokens == len(CACHED)
    for pressure in (True, False):
        busy = _service(native, gpu_blocks=256, evict_under_pressure=pressure)
        for i in range(8):  # 12,000 uncached tokens ahead of a 4,096-token KV pool
            busy.route(_req(f"f{i}", _filler(i)).query(), 0.0, 0.0)
        grant = busy.route(_req("a", prompt).query(), 0.0, 0.0)
        assert grant.cached_tokens == (0 if pressure else len(CACHED))
        assert grant.queue_wait_s is not None and grant.queue_wait_s > 0


@pytest.mark.parametrize("native", [True, False])
def test_the_depth_a_held_prompt_shares_survives_the_pressure(native: bool) -> None:
    """Without held eviction (below, on by default) a held prompt vouches for its depth
    however much is sent after it."""
    busy = _service(native, gpu_blocks=256, evict_held_under_pressure=False)
    busy.route(_req("head", CACHED[:256] + [5] * 300).query(), 0.0, 0.0)  # shares 16 blocks
    for i in range(8):
        busy.route(_req(f"f{i}", _filler(i)).query(), 0.0, 0.0)
    grant = busy.route(_req("a", CACHED + [7] * 200).query(), 0.0, 0.0)
    assert grant.cached_tokens == 256 and grant.cached_tier == "GPU"
    assert grant.cache_source == CacheSource.EVENTS  # the index's hit, cut to what survives


@pytest.mark.parametrize("native", [True, False])
def test_with_held_eviction_a_holder_with_a_pool_behind_it_vouches_for_nothing(
    native: bool,
) -> None:
    """``evict_held_under_pressure``: the holder's blocks are freed when it finishes and the
    12,000 tokens sent after it evict them from a 4,096-token pool before the new prompt
    starts; with the fillers sent *before* the holder nothing is behind it and its depth
    stays."""
    behind = _service(native, gpu_blocks=256, evict_held_under_pressure=True)
    behind.route(_req("head", CACHED[:256] + [5] * 300).query(), 0.0, 0.0)
    for i in range(8):
        behind.route(_req(f"f{i}", _filler(i)).query(), 0.0, 0.0)
    assert behind.route(_req("a", CACHED + [7] * 200).query(), 0.0, 0.0).cached_tokens == 0
    before = _service(native, gpu_blocks=256, evict_held_under_pressure=True)
    for i in range(8):
        before.route(_req(f"f{i}", _filler(i)).query(), 0.0, 0.0)
    before.route(_req("head", CACHED[:256] + [5] * 300).query(), 0.0, 0.0)
    assert before.route(_req("a", CACHED + [7] * 200).query(), 0.0, 0.0).cached_tokens == 256


@pytest.mark.parametrize("native", [True, False])
def test_held_eviction_leaves_a_worker_with_an_offload_tier_alone(native: bool) -> None:
    """Its evicted blocks are offloaded and loaded back: the holder's depth stays."""
    offload = _service(native, gpu_blocks=256, tiers=("GPU", "CPU"), evict_held_under_pressure=True)
    offload.route(_req("head", CACHED[:256] + [5] * 300).query(), 0.0, 0.0)
    for i in range(8):
        offload.route(_req(f"f{i}", _filler(i)).query(), 0.0, 0.0)
    assert offload.route(_req("a", CACHED + [7] * 200).query(), 0.0, 0.0).cached_tokens == 256
