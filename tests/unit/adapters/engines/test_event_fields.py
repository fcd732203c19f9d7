"""Engine events that newer vLLM and SGLang publish beside the three classic ones, decoded
and applied to the index as the engine means them: vLLM's tier-scoped reset
(``TierBlocksCleared``) and SGLang's per-component events of hybrid models
(``component_type``: only "full" is a prefix; a Mamba checkpoint names the last page's
hash and must not move or remove it)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from foretoken.adapters.engines.decoders import (
    DecodedBatch,
    decode_sglang_frames,
    decode_vllm_frames,
)
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.types import ModelName, WorkerId
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored

W = WorkerId("w1")
M = ModelName("m")
BS = 16
PROMPT = list(range(1000, 1000 + 4 * BS))  # four full blocks
HASHES = [0xA000_0000_0000_0001 + i for i in range(4)]


def _frames(batch: Any, seq: int) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def vllm(batch: Any, seq: int = 0) -> DecodedBatch:
    return decode_vllm_frames(_frames(batch, seq), worker_id=W, model=M, default_block_size=BS)


def sglang(batch: Any, seq: int = 0) -> DecodedBatch:
    return decode_sglang_frames(_frames(batch, seq), worker_id=W, model=M,
                                default_block_size=BS)  # fmt: skip


def index_after(*decoded: DecodedBatch) -> PrefixIndex:
    index = PrefixIndex()
    index.register_worker(W, M, BS)
    for one in decoded:
        index.apply(one.batch, 0.0)
    return index


def hit(index: PrefixIndex) -> tuple[int, int, int]:
    h = index.lookup(M, PROMPT)[W]
    return h.tokens, h.gpu_tokens, h.cpu_tokens


def chain(medium: str, **extra: Any) -> list[dict[str, Any]]:
    """The prompt's four blocks as one store per block, each linked to the one before."""
    return [{"type": "BlockStored", "block_hashes": [HASHES[i]],
             "parent_block_hash": HASHES[i - 1] if i else None,
             "token_ids": PROMPT[i * BS:(i + 1) * BS], "block_size": BS, "lora_id": None,
             "medium": medium, **extra} for i in range(4)]  # fmt: skip


# ---------------------------------------------------------------- vLLM TierBlocksCleared


TIER_CLEARS = [{"type": "TierBlocksCleared", "medium": "GPU"},
               {"type": "TierBlocksCleared", "medium": "GPU", "ownership": "kvcr"},
               ["TierBlocksCleared", "GPU", None]]  # fmt: skip


@pytest.mark.parametrize("event", TIER_CLEARS, ids=["map", "map-with-ownership", "array"])
def test_a_tier_scoped_clear_clears_that_tier_only(event: Any) -> None:
    stores = vllm([1.0, chain("GPU") + chain("CPU"), 0], 1)
    assert hit(index_after(stores)) == (64, 64, 0)
    cleared = vllm([2.0, [event], 0], 2)
    assert cleared.batch.events == (AllCleared(medium="GPU"),)
    assert cleared.unknown_tags == {}
    assert hit(index_after(stores, cleared)) == (64, 0, 64)  # the CPU copies remain


def test_a_tier_scoped_clear_of_an_unknown_medium_is_counted_not_applied() -> None:
    decoded = vllm([1.0, [{"type": "TierBlocksCleared", "medium": "HOLOGRAPHIC"}], 0])
    assert decoded.batch.events == () and decoded.unknown_media == {"HOLOGRAPHIC": 1}


# ---------------------------------------------------------------- SGLang component types


def mamba_store(as_array: bool = False) -> Any:
    """SGLang's Mamba checkpoint of the node: one root store of its last page's hash."""
    if as_array:
        return ["BlockStored", [HASHES[-1]], None, PROMPT[-BS:], BS, None, "GPU", "mamba"]
    return {"type": "BlockStored", "block_hashes": [HASHES[-1]], "parent_block_hash": None,
            "token_ids": PROMPT[-BS:], "block_size": BS, "lora_id": None, "medium": "GPU",
            "component_type": "mamba"}  # fmt: skip


def test_full_attention_component_events_are_the_prefix() -> None:
    decoded = sglang([1.0, chain("GPU", component_type="full"), 0])
    assert all(isinstance(e, BlockStored) and e.full_attention for e in decoded.batch.events)
    assert hit(index_after(decoded)) == (64, 64, 0)
    assert decoded.other_components == 0


@pytest.mark.parametrize("as_array", [False, True], ids=["map", "array"])
def test_a_mamba_checkpoint_neither_moves_nor_removes_the_full_attention_page(
    as_array: bool,
) -> None:
    full = sglang([1.0, chain("GPU", component_type="full"), 0], 1)
    checkpoint = sglang([2.0, [mamba_store(as_array)], 0], 2)
    assert checkpoint.batch.events == () and checkpoint.other_components == 1
    removal = ["BlockRemoved", [HASHES[-1]], "GPU", "mamba"] if as_array else {
        "type": "BlockRemoved", "block_hashes": [HASHES[-1]], "medium": "GPU",
        "component_type": "mamba"}  # fmt: skip
    removed = sglang([3.0, [removal], 0], 3)
    assert removed.batch.events == () and removed.other_components == 1
    assert hit(index_after(full, checkpoint, removed)) == (64, 64, 0)


def test_sliding_window_components_and_class_name_tags() -> None:
    swa = {**chain("GPU")[0], "type": "BlockStoredWithComponentType", "component_type": "swa"}
    full = {**chain("GPU")[0], "type": "BlockStoredWithComponentType", "component_type": "full"}
    gone = {"type": "BlockRemovedWithComponentType", "block_hashes": [HASHES[0]],
            "medium": "GPU", "component_type": "full"}  # fmt: skip
    decoded = sglang([1.0, [swa, full, gone], 0])
    assert decoded.other_components == 1
    assert [type(e) for e in decoded.batch.events] == [BlockStored, BlockRemoved]


def test_a_salted_component_store_keeps_its_metadata_after_the_component() -> None:
    event = ["BlockStored", [1], None, [5], 1, None, "GPU", "full", {"cache_salt": "tenant"}]
    (stored,) = sglang([1.0, [event], 0]).batch.events
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == (msgspec.json.encode(["tenant"]).decode(),)


def test_sglang_map_store_of_a_lora_is_credited_to_that_lora_only() -> None:
    """Newer SGLang names the adapter (``lora_name``, with ``lora_id`` nil) in its maps: a
    LoRA's blocks must not hit the base model's prompt of the same tokens."""
    decoded = sglang([1.0, chain("GPU", lora_name="ada"), 0])
    assert all(isinstance(e, BlockStored) and e.lora_name == "ada" for e in decoded.batch.events)
    index = index_after(decoded)
    assert hit(index) == (0, 0, 0)
    assert index.lookup(M, PROMPT, lora_name="ada")[W].tokens == 4 * BS
