"""A busy worker's consecutive KV batches time its steps' prefill (core/cost/kv_steps.py)."""

from __future__ import annotations

from foretoken.core.cost.kv_steps import MAX_HOLD_S, MAX_STEP_S, KvSteps, StepSample
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


def _witnessed() -> KvSteps:
    """Steps a request sent at 0 s and first served at 10⁶ s witnesses all along."""
    steps = KvSteps()
    steps.on_first_token(W, -1.0, 1e6)
    return steps


def _one(steps: KvSteps, batch: KvBatch) -> StepSample | None:
    out = steps.on_batch(batch, BS, 2.0)
    assert len(out) <= 1
    return out[0] if out else None


def test_the_time_between_two_batches_is_the_later_steps_prefill() -> None:
    steps = _witnessed()
    # a prompt of 3 x 4 blocks prefilled in chunks, one step each, prompts queued throughout
    assert _one(steps, _batch(0, 10.0, _run(1, 4, None))) is None  # no step before it
    second = _one(steps, _batch(1, 10.05, _run(5, 4, 4)))
    assert second is not None and second.decoding == 2.0
    assert second.u == 64 and abs(second.seconds - 0.05) < 1e-12 and second.placed
    assert second.v == 128**2 - 64**2  # blocks 4..8 of the chain: tokens 64..128
    third = _one(steps, _batch(2, 10.11, _run(9, 4, 8), _run(100, 2, None)))
    assert third is not None and third.u == 96  # two runs: the chain's next and a new prompt
    assert third.v == (192**2 - 128**2) + 32**2
    assert steps.samples == 2


def test_a_step_is_given_out_once_a_request_that_waited_through_it_has_its_first_token() -> None:
    steps = KvSteps()
    assert steps.on_batch(_batch(0, 1.0, _run(1, 2, None)), BS, 0.0) == []
    assert steps.on_batch(_batch(1, 1.2, _run(3, 2, 2)), BS, 0.0) == []  # held: no witness
    assert steps.on_batch(_batch(2, 1.3, _run(5, 2, 4)), BS, 1.0) == []
    # sent after the first batch: the engine may have idled before it came; a witness of
    # the second step only
    second = steps.on_first_token(W, 1.1, 5.0)
    assert [(x.start_ts, x.end_ts, x.decoding) for x in second] == [(1.2, 1.3, 1.0)]
    assert steps.on_first_token(W, 0.5, 1.15) == []  # first served before the step ended
    first = steps.on_first_token(W, 0.9, 1.3)
    assert [(x.start_ts, x.end_ts) for x in first] == [(1.0, 1.2)]
    assert steps.on_first_token(W, 0.0, 9.0) == []  # each step is given out once
    assert steps.samples == 2


def test_a_first_token_read_before_the_batch_still_witnesses_it() -> None:
    """Outcomes and KV events come on different topics, in either order."""
    steps = KvSteps()
    steps.on_batch(_batch(0, 1.0, _run(1, 2, None)), BS, 0.0)
    assert steps.on_first_token(W, 0.9, 1.21) == []
    assert len(steps.on_batch(_batch(1, 1.2, _run(3, 2, 2)), BS, 0.0)) == 1


def test_idle_gaps_lost_batches_and_clock_jumps_are_no_steps() -> None:
    """Requests sent one after another to an idle worker, while its queue model still holds
    decisions nobody acted on: each request's first batch follows an idle gap."""
    steps = KvSteps()
    t = 0.0
    for i in range(5):  # request i: sent at t, one prefill step, first token, two decode steps
        sent, t = t, t + 0.03
        steps.on_batch(_batch(3 * i, t, _run(10 * i + 1, 4, None)), BS, 0.0)
        assert steps.on_first_token(W, sent, t + 0.001) == []
        for k in (1, 2):
            steps.on_batch(_batch(3 * i + k, t + 0.02 * k, _run(10 * i + 4 + k, 1, None)), BS, 1)
        t += 0.1  # the client reads the answer and sends the next one
    assert steps.samples == 0
    steps = _witnessed()
    steps.on_batch(_batch(0, 1.0, _run(1, 2, None)), BS, 0)
    assert _one(steps, _batch(2, 1.6, _run(5, 2, 4))) is None  # seq 1 lost: maybe two steps
    assert _one(steps, _batch(3, 1.6 + MAX_STEP_S + 1, _run(11, 2, 10))) is None
    assert _one(steps, _batch(4, 1.7, _run(13, 2, 12))) is None  # the clock went back
    assert steps.samples == 0


def test_steps_no_first_token_witnesses_go() -> None:
    steps = KvSteps()
    steps.on_batch(_batch(0, 0.0, _run(1, 1, None)), BS, 0)
    steps.on_batch(_batch(1, 0.1, _run(2, 1, 1)), BS, 0)
    steps.on_batch(_batch(2, 0.1 + MAX_HOLD_S, _run(3, 1, 2)), BS, 0)  # a step of 120 s
    assert steps.unwitnessed == 0
    steps.on_batch(_batch(3, 0.2 + MAX_HOLD_S, _run(4, 1, 3)), BS, 0)
    assert steps.unwitnessed == 1  # the step ended at 0.1 s
    assert len(steps.on_first_token(W, -1.0, 1e6)) == 1  # (the 120 s step is too long)


def test_removals_end_a_step_and_offload_or_other_groups_are_not_prefill() -> None:
    steps = _witnessed()
    _one(steps, _batch(0, 2.0, _run(1, 2, None)))
    removal = BlockRemoved(block_hashes=(EngineBlockHash(99),))
    assert _one(steps, _batch(1, 2.02, removal)) is None  # a step, no prefill
    offload = _run(1, 2, None, medium="CPU")
    other_group = _run(50, 2, None, group_idx=1)
    assert _one(steps, _batch(2, 2.04, offload, other_group)) is None
    sample = _one(steps, _batch(3, 2.07, _run(3, 1, 2), offload))
    assert sample is not None and sample.u == BS and abs(sample.seconds - 0.03) < 1e-12


def test_a_run_whose_parent_is_out_of_reach_counts_in_u_without_v() -> None:
    steps = _witnessed()
    steps.max_blocks = 1  # generations of one block: the last two blocks known
    _one(steps, _batch(0, 0.0, _run(1, 1, None)))  # depths: {1}
    _one(steps, _batch(1, 0.1, _run(10, 1, None)))  # depths: {1}, {10}
    _one(steps, _batch(2, 0.2, _run(20, 1, None)))  # depths: {10}, {20}
    late = _one(steps, _batch(3, 0.3, _run(2, 3, 1), _run(21, 1, 20)))
    assert late is not None and late.u == 4 * BS and not late.placed
    assert late.v == (2 * BS) ** 2 - BS**2  # only the run after block 20 (depth 1 -> 2)
    steps.forget(W)
    assert _one(steps, _batch(4, 0.4, _run(30, 1, None))) is None


def test_a_run_may_continue_from_any_block_of_an_earlier_one() -> None:
    """A prompt that reuses the first blocks of an earlier one (a shared prefix) stores its
    new blocks after one in the middle of that earlier run."""
    steps = _witnessed()
    _one(steps, _batch(0, 0.0, _run(1, 8, None)))  # blocks 1..8, depths 1..8
    sample = _one(steps, _batch(1, 0.04, _run(50, 2, 3)))  # after depth 3
    assert sample is not None and sample.placed
    assert sample.v == (5 * BS) ** 2 - (3 * BS) ** 2
    again = _one(steps, _batch(2, 0.08, _run(60, 1, 3)))  # the prefix, again
    assert again is not None and again.v == (4 * BS) ** 2 - (3 * BS) ** 2
