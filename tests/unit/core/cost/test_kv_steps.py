"""A busy worker's consecutive KV batches time its steps' prefill (core/cost/kv_steps.py)."""

from __future__ import annotations

from foretoken.core.cost.kv_steps import MAX_STEP_S, KvSteps
from foretoken.core.types import (
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KvBatch,
    KvEvent,
    ModelName,
    WorkerId,
)

W = WorkerId("w0")
BS = 16


def _run(first: int, blocks: int, parent: int | None, **kw: object) -> BlockStored:
    hashes = tuple(EngineBlockHash(h) for h in range(first, first + blocks))
    return BlockStored(block_hashes=hashes, block_size=BS,  # type: ignore[arg-type]
                       parent_block_hash=None if parent is None else EngineBlockHash(parent),
                       token_ids=tuple(range(blocks * BS)), **kw)  # fmt: skip


def _batch(seq: int, ts: float, *events: KvEvent) -> KvBatch:
    return KvBatch(worker_id=W, model=ModelName("m"), seq=seq, ts=ts, events=events)


def test_the_time_between_two_batches_is_the_later_steps_prefill() -> None:
    steps = KvSteps()
    # a prompt of 3 x 4 blocks prefilled in chunks, one step each, prompts queued throughout
    assert steps.on_batch(_batch(0, 10.0, _run(1, 4, None)), BS, True) is None  # no step before
    second = steps.on_batch(_batch(1, 10.05, _run(5, 4, 4)), BS, True)
    assert second is not None
    assert second.u == 64 and abs(second.seconds - 0.05) < 1e-12 and second.placed
    assert second.v == 128**2 - 64**2  # blocks 4..8 of the chain: tokens 64..128
    third = steps.on_batch(_batch(2, 10.11, _run(9, 4, 8), _run(100, 2, None)), BS, True)
    assert third is not None and third.u == 96  # two runs: the chain's next and a new prompt
    assert third.v == (192**2 - 128**2) + 32**2
    assert steps.samples == 2


def test_only_while_prompts_queue_at_both_ends_and_batches_are_consecutive() -> None:
    steps = KvSteps()
    steps.on_batch(_batch(0, 1.0, _run(1, 2, None)), BS, False)
    # nothing waited at the previous batch: the engine may have idled in between
    assert steps.on_batch(_batch(1, 1.5, _run(3, 2, 2)), BS, True) is None
    # a lost batch (seq 3 missing): the gap may hold two steps
    assert steps.on_batch(_batch(3, 1.6, _run(5, 2, 4)), BS, True) is None
    # nothing waits now
    assert steps.on_batch(_batch(4, 1.7, _run(7, 2, 6)), BS, False) is None
    steps.on_batch(_batch(5, 1.8, _run(9, 2, 8)), BS, True)
    assert steps.on_batch(_batch(6, 1.8 + MAX_STEP_S + 1, _run(11, 2, 10)), BS, True) is None
    assert steps.on_batch(_batch(7, 1.7, _run(13, 2, 12)), BS, True) is None  # clock backwards
    assert steps.samples == 0


def test_removals_end_a_step_and_offload_or_other_groups_are_not_prefill() -> None:
    steps = KvSteps()
    steps.on_batch(_batch(0, 2.0, _run(1, 2, None)), BS, True)
    removal = BlockRemoved(block_hashes=(EngineBlockHash(99),))
    assert steps.on_batch(_batch(1, 2.02, removal), BS, True) is None  # a step, no prefill
    offload = _run(1, 2, None, medium="CPU")
    other_group = _run(50, 2, None, group_idx=1)
    assert steps.on_batch(_batch(2, 2.04, offload, other_group), BS, True) is None
    sample = steps.on_batch(_batch(3, 2.07, _run(3, 1, 2), offload), BS, True)
    assert sample is not None and sample.u == BS and abs(sample.seconds - 0.03) < 1e-12


def test_a_run_whose_parent_is_out_of_reach_counts_in_u_without_v() -> None:
    steps = KvSteps(max_blocks=1)  # generations of one block: the last two blocks known
    steps.on_batch(_batch(0, 0.0, _run(1, 1, None)), BS, True)  # depths: {1}
    steps.on_batch(_batch(1, 0.1, _run(10, 1, None)), BS, True)  # depths: {1}, {10}
    steps.on_batch(_batch(2, 0.2, _run(20, 1, None)), BS, True)  # depths: {10}, {20}
    late = steps.on_batch(_batch(3, 0.3, _run(2, 3, 1), _run(21, 1, 20)), BS, True)
    assert late is not None and late.u == 4 * BS and not late.placed
    assert late.v == (2 * BS) ** 2 - BS**2  # only the run after block 20 (depth 1 -> 2)
    steps.forget(W)
    assert steps.on_batch(_batch(4, 0.4, _run(30, 1, None)), BS, True) is None


def test_a_run_may_continue_from_any_block_of_an_earlier_one() -> None:
    """A prompt that reuses the first blocks of an earlier one (a shared prefix) stores its
    new blocks after one in the middle of that earlier run."""
    steps = KvSteps()
    steps.on_batch(_batch(0, 0.0, _run(1, 8, None)), BS, True)  # blocks 1..8, depths 1..8
    sample = steps.on_batch(_batch(1, 0.04, _run(50, 2, 3)), BS, True)  # after depth 3
    assert sample is not None and sample.placed
    assert sample.v == (5 * BS) ** 2 - (3 * BS) ** 2
    again = steps.on_batch(_batch(2, 0.08, _run(60, 1, 3)), BS, True)  # the prefix, again
    assert again is not None and again.v == (4 * BS) ** 2 - (3 * BS) ** 2
