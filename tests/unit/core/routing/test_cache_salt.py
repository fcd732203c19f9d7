"""vLLM's ``cache_salt``: the engine keys a salted prompt's first block with the salt (its
``extra_keys``), so it reuses blocks stored under the same salt only. The route service
hashes the prompt the same way: a salted request is credited with its salt's blocks, never
with the unsalted ones of other requests, and an unsalted request never with salted ones.
Both index backends; the route RPC carries the salt."""

from __future__ import annotations

import pytest

from foretoken.core.index.content_hash import salt_key
from foretoken.core.index.native import NativeIndex
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.wire.codec import decode, encode
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
PROMPT = list(range(100, 100 + 64 * BLOCK))


def _service(native: bool) -> RouteService:
    index = NativeIndex() if native else PrefixIndex()
    service = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    for wid in ("w0", "w1"):
        reg = WorkerRegistration(
            worker_id=wid, model=MODEL, engine="vllm", engine_version="x", block_size=BLOCK,
            scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
            endpoints=WorkerEndpoints(http_url=f"http://{wid}"), config_hash="c", ts=0.0,
        )  # fmt: skip
        index.register_worker(wid, MODEL, BLOCK)
        service.on_registration(reg)
    return service


def _store(service: RouteService, wid: str, salt: str | None) -> None:
    n = len(PROMPT) // BLOCK
    keys = (salt_key(salt),) + ("",) * (n - 1) if salt else ()
    start = 1 if salt is None else 1000
    stored = BlockStored(block_hashes=tuple(range(start, start + n)), token_ids=tuple(PROMPT),  # type: ignore[arg-type]
                         block_size=BLOCK, extra_keys=keys)  # fmt: skip
    service.index.apply(KvEventBatch(worker_id=wid, model=MODEL, seq=0, ts=0.0,  # type: ignore[arg-type]
                                     events=(stored,)), 0.0)  # fmt: skip


def _credit(service: RouteService, rid: str, salt: str | None) -> dict[str, int]:
    request = RouteRequest(request_id=rid, model=MODEL, token_ids=tuple(PROMPT), cache_salt=salt)
    wire = decode(encode(request, "msgpack"), RouteRequest)  # the salt survives the RPC
    assert wire.cache_salt == salt
    decision = service.route(wire.query(), 0.0, 0.0)
    return {c.worker_id: c.cached_tokens for c in decision.candidates}


@pytest.mark.parametrize("native", [False, True])
def test_a_salted_prompt_is_credited_with_its_salt_blocks_only(native: bool) -> None:
    service = _service(native)
    _store(service, "w0", None)  # the unsalted prompt on w0
    _store(service, "w1", "tenant-a")  # the same prompt under a salt on w1
    full = len(PROMPT)
    assert _credit(service, "plain", None) == {"w0": full, "w1": 0}
    assert _credit(service, "a", "tenant-a") == {"w0": 0, "w1": full}
    assert _credit(service, "b", "tenant-b") == {"w0": 0, "w1": 0}


def test_the_salt_key_is_the_decoders_canonical_entry() -> None:
    assert salt_key("s") == '["s"]' and salt_key('é"') == '["é\\""]'
