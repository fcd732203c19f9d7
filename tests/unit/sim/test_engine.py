"""The simulated engine's step scheduler against hand-computed step schedules and times.

Unless a test says otherwise: a = 1 ms/token, b = 0, step overhead 10 ms, no decode cost,
no noise, budget 100 tokens, block size 4, so a step's duration can be read off its chunks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.core.types import EngineBlockHash, ModelName, RequestId, WorkerId
from foretoken.sim import engine as engine_module
from foretoken.sim.engine import EngineModel, RequestTooLarge, StepResult
from foretoken.sim.spec import EngineSpec, KvCapacity, TruthSpec
from foretoken.wire.records import BlockRemoved, BlockStored, SchedulerSettings


def make_spec(
    *,
    budget: int = 100,
    max_seqs: int = 8,
    threshold: int = 0,
    chunked: bool = True,
    block_size: int = 4,
    gpu_blocks: int = 1000,
    cpu_blocks: int = 0,
    eagle: bool = False,
    worker: str = "w",
    **truth: float,
) -> EngineSpec:
    costs: dict[str, float] = {
        "prefill_a_s_per_token": 1e-3,
        "prefill_b_s_per_token2": 0.0,
        "step_overhead_s": 0.01,
        **truth,
    }
    seed = int(costs.pop("seed", 0))
    return EngineSpec(
        id=WorkerId(worker),
        model=ModelName("m"),
        block_size=block_size,
        kv=KvCapacity(gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks),
        scheduler=SchedulerSettings(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            long_prefill_token_threshold=threshold,
            chunked_prefill=chunked,
        ),
        eagle=eagle,
        truth=TruthSpec(seed=seed, **costs),
    )


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def submit(engine: EngineModel, rid: str, prompt: list[int], max_tokens: int, at: float) -> None:
    engine.submit(RequestId(rid), prompt, max_tokens, at)


def run_until_idle(engine: EngineModel) -> list[StepResult]:
    results = []
    while (start := engine.next_event_time) is not None:
        results.append(engine.step(start))
    return results


def chunk_list(result: StepResult) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start_token, c.num_tokens) for c in result.chunks]


def first_token_times(results: list[StepResult]) -> dict[str, float]:
    return {ft.request_id: ft.time_s for r in results for ft in r.first_tokens}


# --------------------------------------------------------------------------- scheduling


def test_one_long_prompt_is_chunked_over_steps() -> None:
    engine = EngineModel(make_spec(prefill_b_s_per_token2=1e-6))
    submit(engine, "long", tokens(250), 1, at=0.0)
    steps = run_until_idle(engine)
    assert [chunk_list(s) for s in steps] == [
        [("long", 0, 100)],
        [("long", 100, 100)],
        [("long", 200, 50)],
    ]
    # C(N) = 1e-3·N + 1e-6·N²: C(100)=0.11, C(200)=0.24, C(250)=0.3125.
    assert [s.duration_s for s in steps] == pytest.approx([0.12, 0.14, 0.0825])
    assert first_token_times(steps) == {"long": pytest.approx(0.3425)}
    assert [f.request_id for f in steps[2].finished] == ["long"]


def test_two_prompts_share_the_budget_and_decoding_takes_one_token() -> None:
    engine = EngineModel(make_spec(decode_s_per_seq=0.002, decode_s_per_context_token=1e-5))
    submit(engine, "a", tokens(70), 3, at=0.0)
    submit(engine, "b", tokens(60, 1000), 1, at=0.0)
    steps = run_until_idle(engine)
    assert [chunk_list(s) for s in steps] == [
        [("a", 0, 70), ("b", 0, 30)],
        [("a", 70, 1), ("b", 30, 30)],  # a decodes first (running), b continues
        [("a", 71, 1)],
    ]
    # 0.01 + 0.07 + 0.03; 0.01 + (0.002 + 71e-5) + 0.03; 0.01 + (0.002 + 72e-5)
    assert [s.duration_s for s in steps] == pytest.approx([0.11, 0.04271, 0.01272])
    assert first_token_times(steps) == {"a": pytest.approx(0.11), "b": pytest.approx(0.15271)}
    assert [s.tokens for s in steps] == [("a",), ("a", "b"), ("a",)]
    assert [f.output_tokens for f in steps[2].finished] == [3]
    # a's token gaps: step 2 (with b's chunk) and step 3 (decode only): the fast one.
    assert steps[2].finished[0].decode_step_s == pytest.approx(0.01272)
    assert steps[1].finished[0].decode_step_s is None  # b: one token, no gap


def test_the_step_log_is_trimmed_without_changing_any_token_gap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def finished(log_max: int) -> dict[str, float | None]:
        monkeypatch.setattr(engine_module, "STEP_LOG_MAX", log_max)
        engine = EngineModel(make_spec(decode_s_per_seq=0.002, noise_sigma=0.1, seed=4))
        for i in range(40):  # overlapping requests of 20-60 tokens out
            submit(engine, f"r{i}", tokens(30 + 7 * i, 100 * i), 20 + i % 41, at=0.05 * i)
        done = [f for r in run_until_idle(engine) for f in r.finished]
        assert len(engine._step_ends) <= max(log_max, 1) + 64
        return {f.request_id: f.decode_step_s for f in done}

    kept = finished(1 << 30)
    assert len(kept) == 40 and all(v is not None for v in kept.values())
    assert finished(8) == kept


def test_a_decode_run_gives_its_requests_the_step_between_their_tokens() -> None:
    engine = EngineModel(make_spec(decode_s_per_seq=0.002))
    submit(engine, "r", tokens(50), 10, at=0.0)
    first = engine.step(0.0)  # the prompt: 0.01 + 0.05
    run = engine.decode_run(first.end_s, float("inf"))
    assert run is not None and run.num_steps == 9
    assert [f.decode_step_s for f in run.finished] == [pytest.approx(0.012)]


@pytest.mark.parametrize(
    ("threshold", "small_first_token_s", "giant_first_token_s"),
    [
        # Chunks of 40: the small prompt rides in step 2 beside the giant's second chunk
        # (0.05 + 0.01 + 0.04 + 0.03); the giant needs 10 steps of 0.05, one of them
        # 0.03 longer for the small prompt's 30 tokens.
        (40, 0.13, 0.53),
        # No cap: the giant takes the whole budget for 4 steps of 0.11; the small one
        # runs alone after it (0.44 + 0.01 + 0.03).
        (0, 0.48, 0.44),
    ],
)
def test_a_small_prompt_slips_between_a_giant_ones_chunks(
    threshold: int, small_first_token_s: float, giant_first_token_s: float
) -> None:
    engine = EngineModel(make_spec(threshold=threshold))
    submit(engine, "giant", tokens(400), 1, at=0.0)
    steps = [engine.step(0.0)]
    submit(engine, "small", tokens(30, 5000), 1, at=0.02)  # arrives during step 1
    steps += run_until_idle(engine)
    assert first_token_times(steps) == {
        "small": pytest.approx(small_first_token_s),
        "giant": pytest.approx(giant_first_token_s),
    }
    assert all(s.num_batched_tokens <= 100 for s in steps)


def test_max_num_seqs_holds_back_waiting_requests() -> None:
    engine = EngineModel(make_spec(max_seqs=2))
    for rid in ("a", "b", "c"):
        submit(engine, rid, tokens(10, ord(rid) * 100), 2, at=0.0)
    steps = run_until_idle(engine)
    assert [chunk_list(s) for s in steps] == [
        [("a", 0, 10), ("b", 0, 10)],  # c waits although 80 tokens of budget are left
        [("a", 10, 1), ("b", 10, 1)],
        [("c", 0, 10)],
        [("c", 10, 1)],
    ]


def test_chunked_prefill_off_waits_for_a_prompt_to_fit_whole() -> None:
    engine = EngineModel(make_spec(chunked=False, threshold=10))
    submit(engine, "a", tokens(80), 1, at=0.0)
    submit(engine, "b", tokens(30, 1000), 1, at=0.0)
    steps = run_until_idle(engine)
    assert [chunk_list(s) for s in steps] == [[("a", 0, 80)], [("b", 0, 30)]]


def test_waiting_requests_wait_for_gpu_blocks_in_arrival_order() -> None:
    # a reserves ceil((30 + 3 - 1) / 4) = 8 of 10 blocks; b needs 3; c (behind b) needs 1.
    engine = EngineModel(make_spec(gpu_blocks=10))
    submit(engine, "a", tokens(30), 3, at=0.0)
    submit(engine, "b", tokens(10, 1000), 1, at=0.0)
    submit(engine, "c", tokens(3, 2000), 1, at=0.0)
    steps = run_until_idle(engine)
    assert [chunk_list(s) for s in steps] == [
        [("a", 0, 30)],
        [("a", 30, 1)],
        [("a", 31, 1)],  # a finishes here and frees its blocks
        [("b", 0, 10), ("c", 0, 3)],
    ]


def test_a_request_that_can_never_fit_is_refused() -> None:
    engine = EngineModel(make_spec(gpu_blocks=10))
    with pytest.raises(RequestTooLarge):
        submit(engine, "x", tokens(40), 2, at=0.0)  # ceil(41 / 4) = 11 blocks
    submit(engine, "y", tokens(40), 1, at=0.0)  # exactly 10 blocks
    with pytest.raises(ValueError, match="already"):
        submit(engine, "y", tokens(4), 1, at=0.0)
    with pytest.raises(RequestTooLarge):
        submit(EngineModel(make_spec(chunked=False)), "z", tokens(101), 1, at=0.0)


# --------------------------------------------------------------------------- prefix cache


def test_cached_prefix_is_skipped_and_reported() -> None:
    engine = EngineModel(make_spec(prefill_b_s_per_token2=1e-6))
    submit(engine, "warm", tokens(40), 1, at=0.0)
    run_until_idle(engine)
    submit(engine, "hit", tokens(60), 1, at=1.0)
    (step,) = run_until_idle(engine)
    assert chunk_list(step) == [("hit", 40, 20)]
    # 0.01 + C(60) - C(40) = 0.01 + 0.0636 - 0.0416
    assert step.duration_s == pytest.approx(0.032)
    (first,) = step.first_tokens
    assert (first.cached_tokens, first.cached_tier) == (40, "GPU")
    assert first.ttft_s == pytest.approx(0.032)


def test_repeating_a_whole_prompt_recomputes_its_last_block() -> None:
    engine = EngineModel(make_spec())
    submit(engine, "warm", tokens(40), 1, at=0.0)
    run_until_idle(engine)
    submit(engine, "again", tokens(40), 1, at=1.0)
    (step,) = run_until_idle(engine)
    assert chunk_list(step) == [("again", 36, 4)]
    assert step.first_tokens[0].cached_tokens == 36


def test_eagle_is_credited_one_block_less() -> None:
    engine = EngineModel(make_spec(eagle=True))
    submit(engine, "warm", tokens(40), 1, at=0.0)
    run_until_idle(engine)
    submit(engine, "hit", tokens(60), 1, at=1.0)
    (step,) = run_until_idle(engine)
    assert chunk_list(step) == [("hit", 36, 24)]
    assert step.first_tokens[0].cached_tokens == 36


def test_a_cpu_tier_hit_costs_its_load_time() -> None:
    engine = EngineModel(make_spec(gpu_blocks=12, cpu_blocks=100, cpu_load_s_per_token=1e-4))
    submit(engine, "first", tokens(40), 1, at=0.0)
    submit(engine, "other", tokens(40, 1000), 1, at=0.0)  # evicts first's blocks 9..2
    run_until_idle(engine)
    submit(engine, "back", tokens(44), 1, at=1.0)
    (step,) = run_until_idle(engine)
    # Blocks 0-1 still on GPU, blocks 2-9 (32 tokens) loaded from CPU, 4 tokens computed:
    # 0.01 + 4·1e-3 + 32·1e-4.
    assert chunk_list(step) == [("back", 40, 4)]
    assert step.duration_s == pytest.approx(0.0172)
    (first,) = step.first_tokens
    assert (first.cached_tokens, first.cached_tier) == (40, "CPU")


def _packed(*ids: int) -> bytes:
    return np.array(ids, dtype="<u4").tobytes()


def test_steps_publish_blocks_as_they_fill() -> None:
    engine = EngineModel(make_spec(budget=6))
    submit(engine, "a", tokens(10), 1, at=0.0)
    h0, h1 = engine.cache.hash_prompt(tokens(10))
    first, second = run_until_idle(engine)
    assert first.kv_events == (
        BlockStored(
            block_hashes=(h0,),
            parent_block_hash=None,
            packed_token_ids=_packed(0, 1, 2, 3),
            block_size=4,
        ),
    )
    assert second.kv_events == (
        BlockStored(
            block_hashes=(h1,),
            parent_block_hash=h0,
            packed_token_ids=_packed(4, 5, 6, 7),
            block_size=4,
        ),
    )


def test_engines_publish_different_hashes_for_the_same_prompt() -> None:
    one = EngineModel(make_spec(worker="one")).cache.hash_prompt(tokens(8))
    two = EngineModel(make_spec(worker="two")).cache.hash_prompt(tokens(8))
    assert set(one).isdisjoint(two)


# --------------------------------------------------------------------------- clock, noise


def test_next_event_time_follows_arrivals_and_steps() -> None:
    engine = EngineModel(make_spec())
    assert engine.is_idle and engine.next_event_time is None
    submit(engine, "a", tokens(10), 2, at=5.0)
    assert engine.next_event_time == 5.0
    step = engine.step(5.0)
    assert engine.next_event_time == pytest.approx(step.end_s) == pytest.approx(5.02)
    with pytest.raises(ValueError, match="before the previous step ends"):
        engine.step(5.01)
    run_until_idle(engine)
    assert engine.is_idle and engine.next_event_time is None


def test_a_request_from_the_future_is_not_scheduled_early() -> None:
    engine = EngineModel(make_spec())
    submit(engine, "later", tokens(10), 1, at=3.0)
    assert engine.step(1.0).chunks == ()
    assert chunk_list(engine.step(3.0)) == [("later", 0, 10)]


def test_a_certain_stall_adds_its_duration() -> None:
    engine = EngineModel(make_spec(stall_probability=1.0, stall_s=0.5))
    submit(engine, "a", tokens(10), 1, at=0.0)
    step = engine.step(0.0)
    assert step.stalled and step.duration_s == pytest.approx(0.01 + 0.01 + 0.5)


def test_noise_is_seeded_and_has_median_one() -> None:
    def decode_durations(seed: int) -> np.ndarray:
        engine = EngineModel(make_spec(noise_sigma=0.2, seed=seed, decode_s_per_seq=0.01))
        submit(engine, "a", tokens(4), 400, at=0.0)
        return np.array([s.duration_s for s in run_until_idle(engine)[1:]])

    durations = decode_durations(seed=1)
    assert np.array_equal(durations, decode_durations(seed=1))
    assert not np.array_equal(durations, decode_durations(seed=2))
    log_ratio = np.log(durations / 0.02)  # noiseless decode step: 0.01 + 0.01
    assert abs(np.median(log_ratio)) < 0.05
    assert np.std(log_ratio) == pytest.approx(0.2, abs=0.03)


def test_cancel_frees_blocks_and_drops_the_request() -> None:
    # Each request reserves ceil((30 + 5 - 1) / 4) = 9 of the 12 blocks: one at a time.
    engine = EngineModel(make_spec(gpu_blocks=12))
    submit(engine, "running", tokens(30), 5, at=0.0)
    submit(engine, "waiting", tokens(30, 1000), 5, at=0.0)
    engine.step(0.0)
    assert engine.running_ids() == ("running",) and engine.waiting_ids() == ("waiting",)
    assert engine.cancel(RequestId("waiting"))
    assert engine.cancel(RequestId("running"))
    assert not engine.cancel(RequestId("running"))
    assert engine.is_idle
    stats = engine.stats()
    assert (stats.gpu_blocks_free, stats.gpu_blocks_reserved) == (12, 0)


def test_reset_prefix_cache_is_refused_while_running() -> None:
    engine = EngineModel(make_spec())
    submit(engine, "a", tokens(10), 2, at=0.0)
    engine.step(0.0)
    assert not engine.reset_prefix_cache()
    run_until_idle(engine)
    assert engine.reset_prefix_cache()
    assert len(engine.drain_events()) == 1


# --------------------------------------------------------------------------- properties


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: list[int]
    max_tokens: int


PREFIXES = [tokens(48, 10_000 * k) for k in range(3)]
arrivals = st.lists(
    st.builds(
        Arrival,
        at_s=st.floats(min_value=0.0, max_value=0.5),
        prompt=st.tuples(
            st.integers(0, 2), st.integers(0, 48), st.lists(st.integers(0, 9), max_size=20)
        ).map(lambda t: [*PREFIXES[t[0]][: t[1]], *t[2]] or [7]),
        max_tokens=st.integers(1, 4),
    ),
    min_size=1,
    max_size=12,
)


def replay_fleet(engine: EngineModel, workload: list[Arrival]) -> list[StepResult]:
    """A discrete-event driver: submit at arrival times, step whenever the engine is due."""
    pending = sorted(enumerate(workload), key=lambda item: item[1].at_s)
    results: list[StepResult] = []
    while pending or not engine.is_idle:
        due = engine.next_event_time
        if pending and (due is None or pending[0][1].at_s <= due):
            index, arrival = pending.pop(0)
            submit(engine, f"r{index}", arrival.prompt, arrival.max_tokens, arrival.at_s)
            continue
        assert due is not None
        results.append(engine.step(due))
    return results


@settings(max_examples=120, deadline=None)
@given(
    workload=arrivals,
    budget=st.integers(8, 64),
    threshold=st.integers(0, 24),
    max_seqs=st.integers(1, 4),
    block_size=st.sampled_from([2, 4, 8]),
    gpu_blocks=st.integers(40, 80),
    eagle=st.booleans(),
)
def test_every_request_is_served_and_prefills_exactly_its_uncached_tokens(
    workload: list[Arrival],
    budget: int,
    threshold: int,
    max_seqs: int,
    block_size: int,
    gpu_blocks: int,
    eagle: bool,
) -> None:
    spec = make_spec(
        budget=budget,
        threshold=threshold,
        max_seqs=max_seqs,
        block_size=block_size,
        gpu_blocks=gpu_blocks,
        cpu_blocks=16,
        eagle=eagle,
        decode_s_per_seq=1e-3,
    )
    engine = EngineModel(spec)
    results = replay_fleet(engine, workload)
    prefilled: Counter[str] = Counter()
    for step in results:
        assert 0 < step.num_batched_tokens <= budget
        assert len(step.chunks) <= max_seqs
        for chunk in step.chunks:
            if chunk.prefill:
                prefilled[chunk.request_id] += chunk.num_tokens
                assert threshold == 0 or chunk.num_tokens <= threshold
    firsts = {ft.request_id: ft for step in results for ft in step.first_tokens}
    finished = [f for step in results for f in step.finished]
    assert sorted(f.request_id for f in finished) == sorted(f"r{i}" for i in range(len(workload)))
    for index, arrival in enumerate(workload):
        rid = RequestId(f"r{index}")
        first = firsts[rid]
        assert prefilled[rid] == len(arrival.prompt) - first.cached_tokens
        assert first.cached_tokens % block_size == 0 and first.cached_tokens < len(arrival.prompt)
        assert first.time_s > arrival.at_s
    assert all(f.output_tokens == workload[int(f.request_id[1:])].max_tokens for f in finished)
    stats = engine.stats()
    assert (stats.gpu_blocks_free, stats.gpu_blocks_reserved) == (gpu_blocks, 0)
    copies: Counter[EngineBlockHash] = Counter()
    for step in results:
        for event in step.kv_events:
            if isinstance(event, BlockStored | BlockRemoved) and event.medium == "GPU":
                for block_hash in event.block_hashes:
                    copies[block_hash] += 1 if isinstance(event, BlockStored) else -1
    assert +copies == Counter({h: engine.cache.gpu_copies(h) for h in engine.cache.resident("GPU")})
