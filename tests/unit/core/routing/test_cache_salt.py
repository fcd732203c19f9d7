"""What keys a prompt's blocks besides its tokens. vLLM's ``cache_salt``: the engine keys a
salted prompt's first block with the salt (its ``extra_keys``), so it reuses blocks stored
under the same salt only; the route service hashes the prompt the same way. A LoRA adapter:
its requests go to the workers that serve it, credited with the adapter's blocks only.
Both index backends; the route RPC carries both."""

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


def _service(native: bool, adapters: tuple[str, ...] = ()) -> RouteService:
    index = NativeIndex() if native else PrefixIndex()
    service = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    for wid in ("w0", "w1"):
        reg = WorkerRegistration(
            worker_id=wid, model=MODEL, engine="vllm", engine_version="x", block_size=BLOCK,
            scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
            endpoints=WorkerEndpoints(http_url=f"http://{wid}"), config_hash="c", ts=0.0,
            lora_adapters=adapters if wid == "w1" else (),
        )  # fmt: skip
        index.register_worker(wid, MODEL, BLOCK)
        service.on_registration(reg)
    return service


def _store(service: RouteService, wid: str, salt: str | None, lora: str | None = None) -> None:
    n = len(PROMPT) // BLOCK
    keys = (salt_key(salt),) + ("",) * (n - 1) if salt else ()
    start = 1 if salt is None and lora is None else 1000
    stored = BlockStored(block_hashes=tuple(range(start, start + n)), token_ids=tuple(PROMPT),  # type: ignore[arg-type]
                         block_size=BLOCK, extra_keys=keys, lora_name=lora)  # fmt: skip
    service.index.apply(KvEventBatch(worker_id=wid, model=MODEL, seq=0, ts=0.0,  # type: ignore[arg-type]
                                     events=(stored,)), 0.0)  # fmt: skip


def _credit(service: RouteService, rid: str, salt: str | None,
            lora: str | None = None) -> dict[str, int]:  # fmt: skip
    request = RouteRequest(request_id=rid, model=MODEL, token_ids=tuple(PROMPT), cache_salt=salt,
                           lora_name=lora)  # fmt: skip
    wire = decode(encode(request, "msgpack"), RouteRequest)  # both survive the RPC
    assert wire.cache_salt == salt and wire.lora_name == lora
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


@pytest.mark.parametrize("native", [False, True])
def test_a_lora_request_goes_to_its_workers_credited_with_its_blocks(native: bool) -> None:
    service = _service(native, adapters=("ada",))
    _store(service, "w0", None)  # the base model's blocks of the prompt
    assert _credit(service, "base", None) == {"w0": len(PROMPT), "w1": 0}
    assert _credit(service, "lora-cold", None, "ada") == {"w1": 0}  # only w1 serves it
    _store(service, "w1", None, "ada")  # the adapter's own blocks on w1
    assert _credit(service, "lora", None, "ada") == {"w1": len(PROMPT)}
    assert _credit(service, "base2", None) == {"w0": len(PROMPT), "w1": 0}
    assert _credit(service, "other", None, "bda") == {}  # nobody serves that adapter
    unknown = service.route(RouteRequest(request_id="o2", model=MODEL, token_ids=(1,),
                                         lora_name="bda").query(), 0.0, 0.0)  # fmt: skip
    # not "the prompt exceeds the KV capacity": nobody here serves it (a router that knows
    # an engine with it falls back to its own policy)
    assert not unknown.admitted and unknown.reject_reason == "no_worker_for_model"


def test_the_salt_key_is_the_decoders_canonical_entry() -> None:
    assert salt_key("s") == '["s"]' and salt_key('é"') == '["é\\""]'
