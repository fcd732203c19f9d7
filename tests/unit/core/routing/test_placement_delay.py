"""What a placement costs the prompts already there (``predict.placement_delay_s``): on an
engine that caps each prompt's chunk below its step budget, a new prompt shares their
steps and delays their first tokens; the decision weighs that against its own TTFT."""

from __future__ import annotations

import pytest

from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.predict import placement_delay_s
from foretoken.core.routing.service import RouteService
from foretoken.core.types import SchedulerSettings
from foretoken.wire.records import WorkerEndpoints, WorkerRegistration
from foretoken.wire.route_rpc import RouteRequest
from tests.unit.core.routing.test_service import BLOCK, MODEL, _store

A = 1e-4
CAPPED = SchedulerSettings(max_num_batched_tokens=4096, max_num_seqs=8,
                           long_prefill_token_threshold=1024)  # fmt: skip


def test_a_new_prompt_delays_each_prompt_it_shares_steps_with_by_its_shared_chunks() -> None:
    # two prompts prefilling (3,000 and 20,000 tokens to go), a new one of 5,000: it shares
    # 3,000 tokens' worth of steps with the first and 5,000 with the second
    assert placement_delay_s(CAPPED, [3000, 20_000], 5000, A) == pytest.approx(A * 8000)
    assert placement_delay_s(CAPPED, [], 5000, A) == 0.0
    assert placement_delay_s(CAPPED, [3000], 0, A) == 0.0


def test_a_full_budget_makes_the_new_prompt_wait_for_the_first_to_finish() -> None:
    # 4 chunks of 1,024 fill the budget: with 4 prompts to go it starts once the one
    # closest to done is (1,000 tokens), and then shares the others' last tokens
    lefts = [1000, 3000, 6000, 20_000]
    expected = A * (2000 + 5000 + 5000)  # min(left - 1000, 5000) over the other three
    assert placement_delay_s(CAPPED, lefts, 5000, A) == pytest.approx(expected)


def test_an_engine_without_a_chunk_cap_prefills_in_order_and_nobody_ahead_waits() -> None:
    fifo = SchedulerSettings(max_num_batched_tokens=4096, max_num_seqs=8)
    assert placement_delay_s(fifo, [3000, 20_000], 5000, A) == 0.0
    unchunked = SchedulerSettings(max_num_batched_tokens=4096, chunked_prefill=False,
                                  long_prefill_token_threshold=1024)  # fmt: skip
    assert placement_delay_s(unchunked, [3000], 5000, A) == 0.0


def _service(weight: float) -> RouteService:
    index = PrefixIndex()
    config = PredictorConfig(explore_fraction=0.0, placement_delay_weight=weight)
    p = RouteService(index, config=config)
    for wid in ("w0", "w1"):
        reg = WorkerRegistration(
            worker_id=wid, model=MODEL, engine="vllm", engine_version="x", block_size=BLOCK,
            scheduler=CAPPED, endpoints=WorkerEndpoints(http_url=f"http://{wid}"),
            config_hash="c", ts=0.0,
        )  # fmt: skip
        index.register_worker(reg.worker_id, reg.model, reg.block_size)
        p.on_registration(reg)
    return p


@pytest.mark.parametrize(("weight", "where"), [(0.0, "w0"), (1.0, "w1")])
def test_a_cache_hit_that_would_slow_a_long_prompt_down_is_weighed_against_it(
    weight: float, where: str
) -> None:
    """w0 holds an 8k-token prefix; a 30k-token prompt on it goes there and prefills for
    seconds. A second prompt with the prefix is a little faster on w0 (its hit) than on
    the idle w1, but on w0 it would share the long prompt's steps for 6,000 tokens."""
    p = _service(weight)
    prefix = list(range(8192))
    _store(p, "w0", prefix)
    long = RouteRequest(request_id="long", model=MODEL,
                        token_ids=tuple(prefix + list(range(100_000, 122_000))))  # fmt: skip
    assert p.route(long.query(), 0.0, 0.0).worker_id == "w0"
    tokens = tuple(prefix + list(range(200_000, 206_000)))
    on = {c.prediction.worker_id: c for c in p.predict(MODEL, tokens, 0.0)}
    assert on["w0"].prediction.predicted_ttft_s < on["w1"].prediction.predicted_ttft_s
    second = p.route(RouteRequest(request_id="second", model=MODEL, token_ids=tokens).query(),
                     0.0, 0.0)  # fmt: skip
    assert second.worker_id == where
